"""What an operator used to vLLM expects of ``weir serve``: the periodic stats line, vLLM's
metric names beside Weir's, token counters that move while a request runs, ``--allowed-origins``
as a JSON list, and ``VLLM_API_KEY``."""

from __future__ import annotations

import asyncio
import http.client
import logging
import re
import time
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from server_helpers import metric, request, scrape_metrics, stream_sse, wait_until
from server_inprocess import serve_in_thread
from weir.async_engine import EngineCounters
from weir.server.metrics import VLLM_METRIC_NAMES, ServerMetrics, StatsLogger
from weir.server.settings import ServerSettings, parse_allowed_origins

STATS_LINE = re.compile(r"prompt throughput ([\d.]+) tok/s, generation throughput ([\d.]+) tok/s, running (\d+) "
                        r"reqs, waiting (\d+) reqs, KV cache usage ([\d.]+)%, prefix cache hit rate ([\d.]+)%")
VLLM_LABELS = {"model_name": "tiny", "engine": "0"}


class _SlowSteps:
    """Each forward of the in-process engine takes at least ``seconds``, so a request runs long
    enough to be looked at while it runs."""

    def __init__(self, async_engine, seconds: float):
        self.model = async_engine.engine.runner.model
        self.original = self.model.compute_logits
        self.seconds = seconds
        self.model.compute_logits = self.compute_logits

    def compute_logits(self, hidden):
        time.sleep(self.seconds)
        return self.original(hidden)

    def restore(self) -> None:
        self.model.compute_logits = self.original


def _stats(running=0, waiting=0, usage=0.0, queries=0, hits=0) -> dict:
    return {"num_running": running, "num_waiting": waiting, "kv_cache_usage": usage,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits, "num_preemptions": 0}


# ---- the stats line ------------------------------------------------------------------------

def test_stats_line_reports_the_interval_and_stays_quiet_when_idle(monkeypatch):
    counters = EngineCounters()
    monkeypatch.setattr("weir.server.metrics.time.monotonic", lambda: 100.0)
    stats = StatsLogger(SimpleNamespace(counters=counters), interval=10.0)
    assert stats.line(_stats(), now=110.0) is None  # idle since start: nothing to say
    counters.prompt_tokens, counters.generation_tokens = 2048, 500
    line = stats.line(_stats(running=3, waiting=1, usage=0.25, queries=2048, hits=512), now=120.0)
    assert STATS_LINE.fullmatch(line).groups() == ("204.8", "50.0", "3", "1", "25.0", "25.0")
    counters.generation_tokens = 700  # decode only: no lookups, the last hit rate stays
    line = stats.line(_stats(running=3, usage=0.3, queries=2048, hits=512), now=125.0)
    assert STATS_LINE.fullmatch(line).groups() == ("0.0", "40.0", "3", "0", "30.0", "25.0")
    # The interval in which the work stopped still gets its (zero) line, then silence.
    assert STATS_LINE.fullmatch(stats.line(_stats(queries=2048, hits=512), now=135.0)).group(2) == "0.0"
    assert stats.line(_stats(queries=2048, hits=512), now=145.0) is None
    assert stats.line(_stats(waiting=1, queries=2048, hits=512), now=155.0) is not None  # queued is not idle


@pytest.mark.parametrize("log_stats", [True, False])
@pytest.mark.integration
def test_serve_logs_stats_while_requests_run(tiny_llama_path, caplog, log_stats):
    settings = ServerSettings(log_stats=log_stats, log_stats_interval=0.1)
    caplog.set_level(logging.INFO, logger="weir.stats")
    with serve_in_thread(tiny_llama_path, settings) as (port, engine, _):
        time.sleep(0.4)
        assert not caplog.records  # nothing happened yet
        slow = _SlowSteps(engine, 0.01)
        try:
            status, body = request("POST", port, "/v1/completions",
                                   {"prompt": "hello", "max_tokens": 60, "ignore_eos": True})
        finally:
            slow.restore()
        assert status == 200, body
        time.sleep(0.5)
    lines = [STATS_LINE.fullmatch(record.getMessage()) for record in caplog.records]
    if not log_stats:
        assert lines == []
        return
    assert lines and all(lines), [record.getMessage() for record in caplog.records]
    assert any(float(line.group(2)) > 0 and line.group(3) == "1" for line in lines)
    assert float(lines[-1].group(2)) == 0 and lines[-1].group(3) == "0"  # the line that says it stopped


def test_serve_flags_reach_the_settings(monkeypatch):
    """--disable-log-stats, --log-stats-interval, --allowed-origins and the API-key variables,
    as the CLI hands them on (the settings refuse them here, so no model loads)."""
    from weir.cli.main import app

    seen = {}

    def capture(**options):
        seen.update(options)
        raise ValueError("captured")

    monkeypatch.setattr("weir.cli.serve_cmd.ServerSettings", capture)
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--disable-log-stats", "--log-stats-interval", "2.5",
                                 "--allowed-origins", '["http://a.com", "http://b.org"]'],
                           env={"VLLM_API_KEY": "from-vllm", "WEIR_API_KEY": None})
    assert result.exit_code == 1 and "captured" in result.output
    assert (seen["log_stats"], seen["log_stats_interval"]) == (False, 2.5)
    assert seen["allowed_origins"] == ("http://a.com", "http://b.org") and seen["api_key"] == "from-vllm"
    runner.invoke(app, ["serve"], env={"VLLM_API_KEY": "from-vllm", "WEIR_API_KEY": "from-weir"})
    assert seen["api_key"] == "from-weir" and seen["log_stats"] is True
    runner.invoke(app, ["serve", "--api-key", "given"], env={"VLLM_API_KEY": "from-vllm",
                                                             "VLLM_LOG_STATS_INTERVAL": "4"})
    assert seen["api_key"] == "given" and seen["log_stats_interval"] == 4.0


@pytest.mark.parametrize("interval", [0, -1, float("nan")])
def test_a_stats_interval_that_is_no_positive_number_is_refused(interval):
    with pytest.raises(ValueError, match="log_stats_interval must be a positive number of seconds"):
        ServerSettings(log_stats_interval=interval)


@pytest.mark.parametrize("text, message", [("[not json", "not valid JSON"), ('{"a": 1}', "JSON list of strings"),
                                           ("[1, 2]", "JSON list of strings")])
def test_serve_refuses_bad_allowed_origins(text, message, monkeypatch):
    from weir.cli.main import app

    def no_engine(*args, **kwargs):  # a value taken as valid would otherwise start a server
        raise RuntimeError("the engine must not start")

    monkeypatch.setattr("weir.async_engine.AsyncLLMEngine.from_options", no_engine)
    result = CliRunner().invoke(app, ["serve", "--allowed-origins", text])
    assert result.exit_code == 1 and message in result.output and "--allowed-origins" in result.output


def test_allowed_origins_as_json_or_comma_separated():
    assert parse_allowed_origins('["http://a.com"]') == ("http://a.com",)
    assert parse_allowed_origins(' ["http://a.com", "*"] ') == ("http://a.com", "*")
    assert parse_allowed_origins("http://a.com, http://b.org") == ("http://a.com", "http://b.org")
    assert parse_allowed_origins("*") == ("*",) and parse_allowed_origins("[]") == ()


# ---- metrics -------------------------------------------------------------------------------

def _preflight(port: int, origin: str) -> str | None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("OPTIONS", "/v1/completions", headers={
            "origin": origin, "access-control-request-method": "POST"})
        response = connection.getresponse()
        response.read()
        return response.getheader("access-control-allow-origin")
    finally:
        connection.close()


@pytest.fixture(scope="module")
def ops_server(tiny_llama_path):
    settings = ServerSettings(allowed_origins=parse_allowed_origins('["http://a.com"]'), log_stats=False)
    with serve_in_thread(tiny_llama_path, settings) as (port, engine, _):
        yield port, engine


@pytest.mark.integration
def test_a_json_list_of_origins_is_one_origin_each(ops_server):
    port, _ = ops_server
    assert _preflight(port, "http://a.com") == "http://a.com"
    assert _preflight(port, '["http://a.com"]') is None and _preflight(port, "http://b.org") is None


@pytest.mark.integration
def test_generation_tokens_move_while_the_request_runs_under_both_names(ops_server):
    port, engine = ops_server
    before = scrape_metrics(port)
    body = {"prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True}

    async def scrape_mid_stream():
        first = asyncio.Event()
        stream = asyncio.create_task(stream_sse(port, "/v1/completions", body, first_event=first))
        await first.wait()
        await asyncio.sleep(0.3)
        during = await asyncio.to_thread(scrape_metrics, port)
        return during, await stream

    slow = _SlowSteps(engine, 0.01)
    try:
        during, streamed = asyncio.run(scrape_mid_stream())
    finally:
        slow.restore()
    assert streamed.done
    after = wait_until(lambda: (s := scrape_metrics(port)) and metric(s, "weir:num_requests_running") == 0 and s,
                       timeout=10)

    def delta(samples, name, **labels):
        return metric(samples, name, **labels) - metric(before, name, **labels)

    mid = delta(during, "weir:generation_tokens_total")
    assert metric(during, "weir:num_requests_running") == 1 and 0 < mid < 120  # counted per step, not at the end
    assert delta(during, "vllm:generation_tokens_total", **VLLM_LABELS) == mid
    assert delta(after, "weir:generation_tokens_total") == 120
    assert delta(after, "weir:inter_token_latency_seconds_count") == 119  # one gap per token after the first
    weir_families = {attribute: next(iter(getattr(ServerMetrics(), attribute).collect())).name
                     for attribute in VLLM_METRIC_NAMES}
    for attribute, vllm_name in VLLM_METRIC_NAMES.items():  # every vllm: family mirrors its weir: twin
        family = weir_families[attribute]
        mirrored = [(name, labels, value) for (name, labels), value in after.items()
                    if name in {family + suffix for suffix in ("", "_total", "_bucket", "_count", "_sum")}]
        assert mirrored, family
        for name, labels, value in mirrored:
            twin = vllm_name + name[len(family):]
            assert metric(after, twin, **VLLM_LABELS, **dict(labels)) == value, (name, twin)
    assert metric(after, "vllm:request_success_total", finished_reason="length", **VLLM_LABELS) >= 1
    assert delta(after, "vllm:request_time_per_output_token_seconds_count", **VLLM_LABELS) == 1
    assert ("vllm:kv_cache_usage_perc", tuple(sorted(VLLM_LABELS.items()))) in after


@pytest.mark.integration
def test_engine_counters_count_each_prompt_once_and_every_completion_token(ops_server):
    port, engine = ops_server
    before = (engine.counters.prompt_tokens, engine.counters.generation_tokens)
    status, body = request("POST", port, "/v1/completions",
                           {"prompt": "abc", "max_tokens": 5, "n": 2, "ignore_eos": True})
    assert status == 200, body
    after = (engine.counters.prompt_tokens, engine.counters.generation_tokens)
    assert (after[0] - before[0], after[1] - before[1]) == (body["usage"]["prompt_tokens"], 2 * 5)
