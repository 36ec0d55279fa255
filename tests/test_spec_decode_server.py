"""``weir serve`` with speculative decoding: vLLM's ``metrics.speculative_decoding`` object in chat
and completion responses and on the final stream chunk (only when asked for), the aggregate
counters on /metrics under both names, and bad ``--speculative-config`` values refused at
start-up naming the field."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from typer.testing import CliRunner

from server_helpers import metric, request, scrape_metrics, stream_sse
from server_inprocess import serve_in_thread
from weir.server.settings import ServerSettings

pytestmark = pytest.mark.integration

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3, "adaptive": False})
PROMPT = [5, 6, 7, 8] * 8  # token ids: repeats, so drafts get accepted
FIELDS = {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
          "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens"}


def check_metrics(metrics: dict, detailed: bool) -> None:
    assert set(metrics) == FIELDS | ({"per_step_accepted", "per_step_drafted"} if detailed else set())
    histogram = metrics["acceptance_histogram"]
    assert len(histogram) == metrics["num_spec_tokens"] + 1 == 4
    assert metrics["num_spec_steps"] == sum(histogram) > 0
    assert metrics["num_accepted_draft_tokens"] == sum(j * count for j, count in enumerate(histogram)) > 0
    assert math.isclose(metrics["mean_acceptance_length"],
                        1 + metrics["num_accepted_draft_tokens"] / metrics["num_spec_steps"])
    assert math.isclose(metrics["draft_acceptance_rate"],
                        metrics["num_accepted_draft_tokens"] / metrics["num_draft_tokens"])
    if detailed:
        assert sum(metrics["per_step_accepted"]) == metrics["num_accepted_draft_tokens"]
        assert sum(metrics["per_step_drafted"]) == metrics["num_draft_tokens"]
        assert len(metrics["per_step_accepted"]) == metrics["num_spec_steps"]


@pytest.fixture(scope="module")
def spec_server(tiny_llama_path):
    settings = ServerSettings(log_stats=False)
    with serve_in_thread(tiny_llama_path, settings, speculative_config=NGRAM,
                         per_request_spec_decode_metrics="detailed") as (port, engine, _):
        yield port


def test_completion_and_chat_carry_the_metrics_object(spec_server):
    port = spec_server
    before = scrape_metrics(port)
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, response = request("POST", port, "/v1/completions", body)
    assert status == 200, response
    check_metrics(response["metrics"]["speculative_decoding"], detailed=True)
    one = response["metrics"]["speculative_decoding"]
    # Two prompts and n=2: the object sums all four completions.
    status, response = request("POST", port, "/v1/completions", {**body, "prompt": [PROMPT, PROMPT], "n": 2})
    assert status == 200, response
    both = response["metrics"]["speculative_decoding"]
    check_metrics(both, detailed=True)
    assert both["num_spec_steps"] == 4 * one["num_spec_steps"]  # greedy: four identical completions
    chat = {"messages": [{"role": "user", "content": "abab abab abab abab abab"}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    status, response = request("POST", port, "/v1/chat/completions", chat)
    assert status == 200, response
    assert response["metrics"]["speculative_decoding"]["num_spec_tokens"] == 3
    after = scrape_metrics(port)
    accepted = (metric(after, "weir:spec_decode_num_accepted_tokens_total")
                - metric(before, "weir:spec_decode_num_accepted_tokens_total"))
    assert accepted >= 5 * one["num_accepted_draft_tokens"]
    labels = {"model_name": "tiny", "engine": "0"}
    assert metric(after, "vllm:spec_decode_num_accepted_tokens_total", **labels) == metric(
        after, "weir:spec_decode_num_accepted_tokens_total")
    assert metric(after, "vllm:spec_decode_num_drafts_total", **labels) >= 5 * one["num_spec_steps"]
    first_position = metric(after, "weir:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert first_position > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_the_final_stream_chunk_carries_the_metrics(spec_server, path, include_usage):
    body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "xyxy xyxy xyxy xyxy"}]
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    result = asyncio.run(stream_sse(spec_server, path, body))
    assert result.done
    with_metrics = [event for event in result.events if event.get("metrics") is not None]
    assert len(with_metrics) == 1 and with_metrics[0] is result.events[-1]
    assert (with_metrics[0].get("usage") is not None) == include_usage
    assert with_metrics[0]["metrics"]["speculative_decoding"]["num_spec_tokens"] == 3


def test_responses_are_unchanged_unless_asked(tiny_llama_path):
    with serve_in_thread(tiny_llama_path, ServerSettings(log_stats=False), speculative_config=NGRAM) as (port, _, _):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        status, response = request("POST", port, "/v1/completions", body)
        assert status == 200 and "metrics" not in response
        result = asyncio.run(stream_sse(port, "/v1/completions", {**body, "stream": True}))
        assert result.done and all("metrics" not in event for event in result.events)


@pytest.mark.parametrize("config, field", [
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens"),
    ('{"method": "banana", "num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram"', "not valid JSON")])
def test_serve_refuses_a_bad_speculative_config(tiny_llama_path, config, field):
    from weir.cli.main import app

    result = CliRunner().invoke(app, ["serve", str(tiny_llama_path), "--device", "cpu", "--speculative-config", config])
    assert result.exit_code == 1 and field in result.output and "speculative_config" in result.output


def test_serve_refuses_a_bad_metrics_level(tiny_llama_path):
    from weir.cli.main import app

    result = CliRunner().invoke(app, ["serve", str(tiny_llama_path), "--device", "cpu",
                                      "--per-request-spec-decode-metrics", "everything"])
    assert result.exit_code == 1 and "per_request_spec_decode_metrics" in result.output
