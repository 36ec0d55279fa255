"""Prometheus metrics (prometheus-client), named as vLLM names them under ``weir:``, and offered
again under vLLM's own ``vllm:`` names so dashboards built for vLLM read a Weir server.

Each server owns its own ``CollectorRegistry`` (no process-global metrics), so several apps in
one process (tests) never share counters. Engine gauges are read on the engine thread when
``/metrics`` is scraped; generated tokens come from the engine loop's per-step counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

stats_logger = logging.getLogger("weir.stats")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


@dataclass
class RequestRecord:
    """One engine request's timeline, for the latency histograms."""

    num_prompt_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_steps_seen: int = 0  # tokens of the longest completion the handler has seen
    num_generated_tokens: int = 0
    done: bool = False


def read_engine_stats(engine) -> dict:
    """Runs in the engine's loop (the clients' ``call``), so it sees a consistent state."""
    scheduler = engine.scheduler
    kv_cache = scheduler.kv_cache
    stats = {"num_running": scheduler.num_running, "num_waiting": scheduler.num_waiting,
             "kv_cache_usage": kv_cache.usage(), "prefix_cache_queries": kv_cache.num_prefix_queries,
             "prefix_cache_hits": kv_cache.num_prefix_hits, "num_preemptions": scheduler.num_preemptions}
    spec = getattr(scheduler, "spec", None)
    if spec is not None:
        stats["spec_decode"] = spec.counters.snapshot()
    return stats


class ServerMetrics:
    def __init__(self):
        registry = self.registry = CollectorRegistry()
        self.http_requests = Counter("weir:http_requests", "HTTP requests answered, by endpoint and status code",
                                     ["endpoint", "status"], registry=registry)
        self.request_finished = Counter("weir:request_success", "Engine requests finished, by finish reason",
                                        ["finished_reason"], registry=registry)
        self.prompt_tokens = Counter("weir:prompt_tokens", "Prompt tokens of requests admitted to the engine",
                                     registry=registry)
        self.generation_tokens = Counter("weir:generation_tokens", "Tokens generated (counted each engine step)",
                                         registry=registry)
        self.num_running = Gauge("weir:num_requests_running", "Requests in the engine's running batch",
                                 registry=registry)
        self.num_waiting = Gauge("weir:num_requests_waiting", "Requests waiting in the engine's queue",
                                 registry=registry)
        self.num_in_flight = Gauge("weir:num_requests_in_flight", "Requests admitted by the server, not yet "
                                   "answered", registry=registry)
        self.kv_cache_usage = Gauge("weir:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)",
                                    registry=registry)
        self.prefix_cache_hit_rate = Gauge("weir:prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                                           "cache / prompt tokens looked up, since start", registry=registry)
        self.prefix_cache_queries = Counter("weir:prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache", registry=registry)
        self.prefix_cache_hits = Counter("weir:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                         registry=registry)
        self.num_preemptions = Counter("weir:num_preemptions", "Requests preempted (recomputed later)",
                                       registry=registry)
        self.ttft = Histogram("weir:time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("weir:inter_token_latency_seconds", "Time between successive output tokens, as "
                             "the server hands them out", buckets=ITL_BUCKETS, registry=registry)
        self.tpot = Histogram("weir:time_per_output_token_seconds", "Mean time between output tokens, "
                              "per completion (vllm:request_time_per_output_token_seconds)", buckets=TPOT_BUCKETS,
                              registry=registry)
        self.e2e = Histogram("weir:e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=E2E_BUCKETS, registry=registry)
        # Speculative decoding (only while the engine speculates): spec steps, drafts verified,
        # drafts accepted, and accepted by draft position.
        self.spec_num_drafts = Counter("weir:spec_decode_num_drafts", "Speculative steps (a request's step that "
                                       "verified drafts)", registry=registry)
        self.spec_num_draft_tokens = Counter("weir:spec_decode_num_draft_tokens", "Draft tokens verified",
                                             registry=registry)
        self.spec_num_accepted_tokens = Counter("weir:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                                registry=registry)
        self.spec_accepted_per_pos = Counter("weir:spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                             "accepted at each draft position (0 = the first draft)", ["position"],
                                             registry=registry)
        self._spec_counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self._spec_per_position: list[int] = []
        self._engine_counts = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}
        self._step_counters = None  # the engine loop's EngineCounters, once follow_engine is called
        self._generation_tokens_counted = 0

    def follow_engine(self, step_counters, model_name: str) -> None:
        """Count generated tokens from the engine loop's per-step ``EngineCounters``, and offer
        every metric vLLM also has under its ``vllm:`` name, labelled with ``model_name``."""
        self._step_counters = step_counters
        self.registry.register(VllmNames(self, model_name))

    def observe_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def new_request(self, num_prompt_tokens: int) -> RequestRecord:
        return RequestRecord(num_prompt_tokens, time.monotonic())

    def admitted(self, record: RequestRecord) -> None:
        self.prompt_tokens.inc(record.num_prompt_tokens)

    def tokens_arrived(self, record: RequestRecord, token_counts: list[int]) -> bool:
        """A handler saw an output whose completions hold ``token_counts`` tokens; True when
        it carries the request's first token. The time since the previous output is shared by
        the steps it covers (a reader that fell behind sees several at once)."""
        num_steps = max(token_counts, default=0)
        new_steps = num_steps - record.num_steps_seen
        if new_steps <= 0:
            return False
        now = time.monotonic()
        first = record.first_token_time is None
        if first:  # tokens that came with the first one took their time inside the TTFT
            record.first_token_time = now
            self.ttft.observe(now - record.arrival_time)
        else:
            gap = (now - record.last_token_time) / new_steps
            for _ in range(new_steps):
                self.itl.observe(gap)
        record.last_token_time, record.num_steps_seen = now, num_steps
        return first

    def finished(self, record: RequestRecord, finished_reasons: list[str], tokens_per_completion: list[int]) -> None:
        """Once per engine request; one reason and one token count per completion (``n`` of them)."""
        if record.done:
            return
        record.done = True
        record.num_generated_tokens = sum(tokens_per_completion)  # the counter moved step by step
        for reason in finished_reasons:
            self.request_finished.labels(finished_reason=reason).inc()
        if all(reason in ("stop", "length") for reason in finished_reasons):
            now = time.monotonic()
            self.e2e.observe(now - record.arrival_time)
            # Per completion: the n completions run side by side, so their tokens are not one
            # sequence (dividing by all of them made TPOT n times too small).
            for num_tokens in tokens_per_completion:
                if record.first_token_time is not None and num_tokens > 1:
                    self.tpot.observe((now - record.first_token_time) / (num_tokens - 1))

    def update_engine(self, stats: dict, num_in_flight: int) -> None:
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.num_in_flight.set(num_in_flight)
        self.kv_cache_usage.set(stats["kv_cache_usage"])
        queries = stats["prefix_cache_queries"]
        self.prefix_cache_hit_rate.set(stats["prefix_cache_hits"] / queries if queries else 0.0)
        for name, counter in (("prefix_cache_queries", self.prefix_cache_queries),
                              ("prefix_cache_hits", self.prefix_cache_hits),
                              ("num_preemptions", self.num_preemptions)):
            # The engine keeps running totals; a counter only moves forward by the difference.
            counter.inc(max(0, stats[name] - self._engine_counts[name]))
            self._engine_counts[name] = max(self._engine_counts[name], stats[name])
        spec = stats.get("spec_decode")
        if spec is not None:
            for name, counter in (("num_drafts", self.spec_num_drafts),
                                  ("num_draft_tokens", self.spec_num_draft_tokens),
                                  ("num_accepted_tokens", self.spec_num_accepted_tokens)):
                counter.inc(max(0, spec[name] - self._spec_counts[name]))
                self._spec_counts[name] = max(self._spec_counts[name], spec[name])
            per_position = spec["accepted_per_position"]
            self._spec_per_position += [0] * (len(per_position) - len(self._spec_per_position))
            for position, count in enumerate(per_position):
                self.spec_accepted_per_pos.labels(position=str(position)).inc(
                    max(0, count - self._spec_per_position[position]))
                self._spec_per_position[position] = max(self._spec_per_position[position], count)

    def render(self) -> tuple[bytes, str]:
        if self._step_counters is not None:
            generated = self._step_counters.generation_tokens
            self.generation_tokens.inc(max(0, generated - self._generation_tokens_counted))
            self._generation_tokens_counted = max(self._generation_tokens_counted, generated)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# ServerMetrics attribute -> the name vLLM gives the same metric (its dashboards read these).
VLLM_METRIC_NAMES = {
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "request_finished": "vllm:request_success",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "num_preemptions": "vllm:num_preemptions",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
# The same for speculative decoding's counters (which stay at zero, or unlabelled, without it).
VLLM_SPEC_METRIC_NAMES = {
    "spec_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "spec_accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


class VllmNames:
    """A collector that re-exports the ``weir:`` metrics vLLM also has under vLLM's names and
    labels (``model_name``, ``engine``). It copies each scrape's samples, so nothing is counted
    twice and the two names can never disagree."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self.metrics = metrics
        self.labels = {"model_name": model_name, "engine": "0"}

    def collect(self):
        for attribute, vllm_name in {**VLLM_METRIC_NAMES, **VLLM_SPEC_METRIC_NAMES}.items():
            for family in getattr(self.metrics, attribute).collect():
                renamed = Metric(vllm_name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    suffix = sample.name[len(family.name):]  # _total, _bucket, _sum, _created, ...
                    renamed.add_sample(vllm_name + suffix, {**self.labels, **sample.labels}, sample.value,
                                       sample.timestamp, sample.exemplar)
                yield renamed


class StatsLogger:
    """The periodic stats line of a serving engine, as vLLM logs it: prompt and generation
    throughput over the interval, running and waiting requests, KV cache usage, prefix cache
    hit rate. Throughput comes from the engine loop's counters; the rest is read on the engine
    thread once per interval (one queued command: the step loop does nothing more). A line is
    logged only while something happens, and once more when it stops."""

    def __init__(self, engine, interval: float, log=stats_logger.info):
        self.engine = engine
        self.interval = interval
        self.log = log
        self._last = self._snapshot({"prefix_cache_queries": 0, "prefix_cache_hits": 0}, time.monotonic())
        self._hit_rate = 0.0  # of the last interval that looked anything up
        self._was_active = False

    def _snapshot(self, stats: dict, now: float) -> tuple[float, int, int, int, int]:
        counters = self.engine.counters
        return (now, counters.prompt_tokens, counters.generation_tokens, stats["prefix_cache_queries"],
                stats["prefix_cache_hits"])

    def line(self, stats: dict, now: float) -> str | None:
        """The line for the interval that ends ``now`` (``stats``: ``read_engine_stats``), or
        None when the engine was idle through it and through the one before."""
        current = self._snapshot(stats, now)
        (then, prompt, generated, queries, hits), self._last = self._last, current
        elapsed = max(now - then, 1e-9)
        prompt_rate, generation_rate = (current[1] - prompt) / elapsed, (current[2] - generated) / elapsed
        if current[3] > queries:
            self._hit_rate = (current[4] - hits) / (current[3] - queries)
        active = bool(prompt_rate or generation_rate or stats["num_running"] or stats["num_waiting"])
        was_active, self._was_active = self._was_active, active
        if not (active or was_active):
            return None
        return (f"prompt throughput {prompt_rate:.1f} tok/s, generation throughput {generation_rate:.1f} tok/s, "
                f"running {stats['num_running']} reqs, waiting {stats['num_waiting']} reqs, "
                f"KV cache usage {stats['kv_cache_usage']:.1%}, prefix cache hit rate {self._hit_rate:.1%}")

    async def run(self) -> None:
        """Log every ``interval`` seconds until cancelled or the engine stops."""
        from weir.streams import EngineDeadError

        while True:
            await asyncio.sleep(self.interval)
            if not self.engine.is_running:
                return
            try:
                stats = await self.engine.call_async(read_engine_stats)
            except EngineDeadError:
                return
            except Exception:  # a stats bug must not go unseen, nor touch serving: stop the lines only
                stats_logger.exception("cannot read the engine's stats; no more stats lines")
                return
            line = self.line(stats, time.monotonic())
            if line is not None:
                self.log(line)
