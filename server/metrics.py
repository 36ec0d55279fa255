"""Prometheus metrics (prometheus-client), named as vLLM names them but under ``weir:``.

Each server owns its own ``CollectorRegistry`` (no process-global metrics), so several apps in
one process (tests) never share counters. Engine gauges are read on the engine thread when
``/metrics`` is scraped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


@dataclass
class RequestRecord:
    """One engine request's timeline, for the latency histograms."""

    num_prompt_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    num_generated_tokens: int = 0
    done: bool = False


def read_engine_stats(engine) -> dict:
    """Runs on the engine thread (``AsyncLLMEngine.call``), so it sees a consistent state."""
    scheduler = engine.scheduler
    kv_cache = scheduler.kv_cache
    return {"num_running": scheduler.num_running, "num_waiting": scheduler.num_waiting,
            "kv_cache_usage": kv_cache.usage(), "prefix_cache_queries": kv_cache.num_prefix_queries,
            "prefix_cache_hits": kv_cache.num_prefix_hits, "num_preemptions": scheduler.num_preemptions}


class ServerMetrics:
    def __init__(self):
        registry = self.registry = CollectorRegistry()
        self.http_requests = Counter("weir:http_requests", "HTTP requests answered, by endpoint and status code",
                                     ["endpoint", "status"], registry=registry)
        self.request_finished = Counter("weir:request_success", "Engine requests finished, by finish reason",
                                        ["finished_reason"], registry=registry)
        self.prompt_tokens = Counter("weir:prompt_tokens", "Prompt tokens of requests admitted to the engine",
                                     registry=registry)
        self.generation_tokens = Counter("weir:generation_tokens", "Tokens generated", registry=registry)
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
        self.tpot = Histogram("weir:time_per_output_token_seconds", "Mean time between output tokens, "
                              "per completion (vLLM's metric of this name is per step)", buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram("weir:e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=E2E_BUCKETS, registry=registry)
        self._engine_counts = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}

    def observe_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def new_request(self, num_prompt_tokens: int) -> RequestRecord:
        return RequestRecord(num_prompt_tokens, time.monotonic())

    def admitted(self, record: RequestRecord) -> None:
        self.prompt_tokens.inc(record.num_prompt_tokens)

    def first_token(self, record: RequestRecord) -> None:
        record.first_token_time = time.monotonic()
        self.ttft.observe(record.first_token_time - record.arrival_time)

    def finished(self, record: RequestRecord, finished_reasons: list[str], tokens_per_completion: list[int]) -> None:
        """Once per engine request; one reason and one token count per completion (``n`` of them)."""
        if record.done:
            return
        record.done = True
        record.num_generated_tokens = sum(tokens_per_completion)
        self.generation_tokens.inc(record.num_generated_tokens)
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

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
