"""``weir bench``: throughput and latency on a tiny dummy-weight model on the CPU, and serve
against an in-process fake OpenAI streaming server."""

from __future__ import annotations

import json
import random
import re
import sys
import types

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from bench_fake_server import FAKE_MODEL, TOKEN_DELAY_SECONDS, FakeOpenAIServer
from helpers_models import TINY_VOCAB_SIZE
from weir.cli.bench import bench_app
from weir.cli.bench.latency import decode_weight_bytes
from weir.cli.bench.throughput import parse_random_range, random_workload

TINY_ENGINE = ["--load-format", "dummy", "--device", "cpu", "--max-model-len", "128", "--block-size", "4"]


@pytest.fixture(scope="module")
def fake_server():
    with FakeOpenAIServer() as server:
        yield server


def _invoke(*args: str):
    return CliRunner().invoke(bench_app, [str(arg) for arg in args])


# ---- throughput --------------------------------------------------------------------------

def test_random_workload_draws_in_the_nano_benchmark_order():
    random.seed(7)
    expected_prompts = [[random.randint(0, 50) for _ in range(random.randint(3, 9))] for _ in range(5)]
    expected_max_tokens = [random.randint(2, 6) for _ in range(5)]
    assert random_workload(5, (3, 9), (2, 6), seed=7, max_token_id=50) == (expected_prompts, expected_max_tokens)


def test_parse_random_range():
    assert parse_random_range("100:1024,1:64") == ((100, 1024), (1, 64))
    for bad in ("100:1024", "1:2,3", "a:b,1:2", "5:4,1:2", "0:4,1:2"):
        with pytest.raises(ValueError, match="--random-range"):
            parse_random_range(bad)


def test_throughput_random_range(config_only_qwen3, tmp_path):
    result_file = tmp_path / "throughput.json"
    result = _invoke("throughput", config_only_qwen3, *TINY_ENGINE, "--seed", "3", "--num-prompts", "6",
                     "--random-range", "4:20,2:9", "--output-json", result_file)
    assert result.exit_code == 0, result.output
    match = re.search(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s",
                      result.output)
    assert match, result.output
    assert "Engine start-up:" in result.output
    record = json.loads(result_file.read_text())
    prompts, max_tokens = random_workload(6, (4, 20), (2, 9), seed=3, max_token_id=TINY_VOCAB_SIZE - 1)
    assert record["num_requests"] == 6
    assert record["prompt_tokens"] == sum(len(prompt) for prompt in prompts)
    assert record["output_tokens"] == sum(max_tokens)  # --ignore-eos is on by default
    assert record["output_tokens_per_second"] == pytest.approx(record["output_tokens"] / record["elapsed_seconds"])
    assert float(match.group(3)) == pytest.approx(record["output_tokens_per_second"], rel=1e-2)
    assert record["startup_seconds"] > 0


def test_throughput_fixed_lengths(config_only_qwen3, tmp_path):
    result_file = tmp_path / "throughput.json"
    result = _invoke("throughput", config_only_qwen3, *TINY_ENGINE, "--num-prompts", "4",
                     "--input-len", "7", "--output-len", "5", "--output-json", result_file)
    assert result.exit_code == 0, result.output
    record = json.loads(result_file.read_text())
    assert (record["prompt_tokens"], record["output_tokens"]) == (4 * 7, 4 * 5)


@pytest.mark.parametrize("lengths, message", [
    (["--input-len", "4", "--output-len", "2", "--random-range", "1:2,1:2"], "not both"),
    (["--input-len", "4"], "pass --input-len and --output-len"),
    (["--input-len", "100", "--output-len", "100"], "exceed max_model_len=128"),
])
def test_throughput_rejects_bad_lengths(config_only_qwen3, lengths, message):
    result = _invoke("throughput", config_only_qwen3, *TINY_ENGINE, *lengths)
    assert result.exit_code == 1
    assert message in result.output
    assert result.output.count("error:") == 1, result.output  # said once, not followed by "error: 1"


def test_an_output_path_that_cannot_be_written_fails_before_the_run(config_only_qwen3, tmp_path):
    result = _invoke("throughput", config_only_qwen3, *TINY_ENGINE, "--input-len", "4", "--output-len", "2",
                     "--output-json", tmp_path)
    assert result.exit_code == 1 and "is a directory" in result.output
    assert "Engine start-up" not in result.output


def test_throughput_without_dummy_names_the_missing_checkpoint(config_only_qwen3):
    result = _invoke("throughput", config_only_qwen3, "--device", "cpu", "--input-len", "4", "--output-len", "2")
    assert result.exit_code == 1
    assert "no checkpoint" in result.output and "--load-format dummy" in result.output


# ---- latency -----------------------------------------------------------------------------

def test_latency_reports_percentiles_and_bandwidth(config_only_qwen3, tmp_path):
    result_file = tmp_path / "latency.json"
    result = _invoke("latency", config_only_qwen3, *TINY_ENGINE, "--batch-size", "2", "--input-len", "8",
                     "--output-len", "6", "--num-iters", "3", "--num-iters-warmup", "1",
                     "--output-json", result_file)
    assert result.exit_code == 0, result.output
    for line in ("Avg latency:", "10% percentile latency:", "99% percentile latency:",
                 "weight bytes / step time:", "Device copy bandwidth:", "Achieved fraction of copy bandwidth:"):
        assert line in result.output
    record = json.loads(result_file.read_text())
    latencies = record["latencies_seconds"]
    assert len(latencies) == 3 and len(record["prefill_latencies_seconds"]) == 3
    assert record["avg_latency_seconds"] == pytest.approx(sum(latencies) / 3)
    points = list(record["percentiles_seconds"].values())
    assert list(record["percentiles_seconds"]) == ["p10", "p25", "p50", "p75", "p90", "p99"]
    assert points == sorted(points) and min(latencies) <= points[0] and points[-1] <= max(latencies)
    assert record["fraction_of_copy_bandwidth"] == pytest.approx(
        record["achieved_bytes_per_second"] / record["copy_bandwidth_bytes_per_second"])
    # tied embeddings: every parameter is read each step
    from transformers import Qwen3Config
    config = Qwen3Config.from_pretrained(config_only_qwen3)
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter + 2 * hidden + 2 * config.head_dim
    expected = (config.vocab_size * hidden + layers * per_layer + hidden) * 4  # fp32 on the CPU
    assert record["weight_bytes_per_decode_step"] == expected


class _TinyLM(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.layer = nn.Linear(4, 4, bias=False)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("tied, expected_elements", [(True, 40 + 16), (False, 16 + 40)])
def test_decode_weight_bytes_skips_only_an_untied_input_embedding(tied, expected_elements):
    model = _TinyLM(tied).to(torch.bfloat16)
    assert decode_weight_bytes(model) == expected_elements * 2
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total == (56 if tied else 96) * 2


class _TinyMoE(nn.Module):
    """One routed-expert layer (8 experts, top 2) beside a dense one."""

    def __init__(self, num_shared_experts: int = 0):
        super().__init__()
        from weir.layers.moe import FusedExperts
        from weir.moe import Routing

        self.dense = nn.Linear(4, 4, bias=False)
        self.experts = FusedExperts(num_experts=8, hidden_size=4, intermediate_size=2,
                                    num_shared_experts=num_shared_experts,
                                    routing=Routing.softmax_top_k(8, 2, renormalize=True))


def test_decode_weight_bytes_count_only_the_experts_a_step_reaches():
    model = _TinyMoE()
    dense, expert = 16 * 4, (2 * 2 * 4 + 4 * 2) * 4  # fp32 bytes: the Linear, one expert's gate/up/down
    assert decode_weight_bytes(model, batch_size=1) == dense + 2 * expert  # exactly top_k at batch 1
    expected_experts = 8 * (1 - (1 - 2 / 8) ** 3)  # three tokens, uniform routing
    assert decode_weight_bytes(model, batch_size=3) == round(dense + expected_experts * expert)
    assert decode_weight_bytes(model, batch_size=1000) == dense + 8 * expert
    # A shared expert stored beside the routed ones is read by every step.
    model = _TinyMoE(num_shared_experts=1)
    assert decode_weight_bytes(model, batch_size=1) == dense + 3 * expert
    assert decode_weight_bytes(model, batch_size=3) == round(dense + (expected_experts + 1) * expert)


# ---- serve -------------------------------------------------------------------------------

def test_serve_completions_token_ids_and_save_result(fake_server, tmp_path):
    pytest.importorskip("matplotlib", reason="--save-result draws its PNG with the [bench] extra")
    fake_server.state.reset(fail_every=3)
    result_file = tmp_path / "out" / "serve.json"
    result = _invoke("serve", "--base-url", fake_server.base_url, "--num-prompts", "6", "--random-input-len", "12",
                     "--random-output-len", "5", "--ignore-eos", "--save-result", "--save-detailed",
                     "--result-dir", tmp_path / "out", "--result-filename", "serve.json")
    assert result.exit_code == 0, result.output
    assert re.search(r"Successful requests\s+4\n", result.output)
    assert re.search(r"Failed requests\s+2\n", result.output)
    for label in ("Mean TTFT (ms)", "Median TPOT (ms)", "P99 ITL (ms)", "Mean E2EL (ms)",
                  "Request throughput (req/s)", "Output token throughput (tok/s)", "Total token throughput"):
        assert label in result.output
    bodies = fake_server.state.bodies
    assert len(bodies) == 6
    for body in bodies:
        assert body["model"] == FAKE_MODEL  # found at /v1/models
        assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
        assert len(body["prompt"]) == 12 and all(isinstance(token, int) for token in body["prompt"])
    record = json.loads(result_file.read_text())
    # vLLM's names, so its tooling reads Weir's results
    assert (record["completed"], record["failed"], record["num_prompts"]) == (4, 2, 6)
    assert record["total_output_tokens"] == 4 * 5 and record["total_input_tokens"] == 4 * 12
    assert record["output_throughput"] == pytest.approx(record["total_output_tokens"] / record["duration"])
    assert record["request_rate"] == "inf" and record["model_id"] == FAKE_MODEL and record["backend"] == "openai"
    done = [index for index, error in enumerate(record["errors"]) if not error]
    assert len(done) == 4 and all("HTTP 500" in record["errors"][i] for i in set(range(6)) - set(done))
    ttfts, latencies, itls = (record["ttfts"], record["latencies"], record["itls"])
    assert [record["output_lens"][i] for i in done] == [5] * 4 and [len(itls[i]) for i in done] == [4] * 4
    assert all(0 < ttfts[i] < latencies[i] for i in done)
    assert min(latencies[i] for i in done) >= 0.9 * 5 * TOKEN_DELAY_SECONDS  # the server sleeps before each token
    assert record["mean_ttft_ms"] == pytest.approx(1e3 * sum(ttfts[i] for i in done) / 4)
    tpots = [(latencies[i] - ttfts[i]) * 1e3 / 4 for i in done]
    assert record["median_tpot_ms"] == pytest.approx(sorted(tpots)[1] / 2 + sorted(tpots)[2] / 2)
    assert record["p99_itl_ms"] <= 1e3 * max(gap for i in done for gap in itls[i]) + 1e-6
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p99_{name}_ms"} <= set(record)
    assert result_file.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_save_result_names_the_file_as_vllm(fake_server, tmp_path, monkeypatch):
    fake_server.state.reset()
    monkeypatch.chdir(tmp_path)
    result = _invoke("serve", "--base-url", fake_server.base_url, "--num-prompts", "2", "--random-input-len", "3",
                     "--random-output-len", "2", "--request-rate", "50", "--max-concurrency", "2",
                     "--save-result", "--no-plot")
    assert result.exit_code == 0, result.output
    [written] = list(tmp_path.iterdir())
    assert re.fullmatch(rf"openai-50\.0qps-concurrency2-{FAKE_MODEL}-\d{{8}}-\d{{6}}\.json", written.name)
    record = json.loads(written.read_text())
    assert record["request_rate"] == 50.0 and record["max_concurrency"] == 2 and record["completed"] == 2
    assert "ttfts" not in record  # per-request lists only with --save-detailed, as vLLM


def test_serve_chat_respects_max_concurrency(fake_server):
    fake_server.state.reset(send_usage=False)  # output tokens are then counted from the chunks
    result = _invoke("serve", "--base-url", fake_server.base_url, "--model", "named-model",
                     "--endpoint", "/v1/chat/completions", "--num-prompts", "6", "--max-concurrency", "2",
                     "--random-input-len", "9", "--random-output-len", "6")
    assert result.exit_code == 0, result.output
    assert re.search(r"Successful requests\s+6\n", result.output)
    # 6 x 6 content chunks: the role-only first delta and the finish chunk are no tokens
    assert re.search(r"Total output tokens\s+36\n", result.output)
    assert re.search(r"Total prompt tokens\s+54\n", result.output)  # without usage: the words sent
    assert fake_server.state.max_in_flight == 2
    body = fake_server.state.bodies[0]
    assert body["model"] == "named-model" and body["ignore_eos"] is False
    assert len(body["messages"][0]["content"].split()) == 9


def test_serve_unbounded_sends_at_once_and_poisson_spreads_arrivals(fake_server):
    fake_server.state.reset()
    result = _invoke("serve", "--base-url", fake_server.base_url, "--num-prompts", "6",
                     "--random-input-len", "4", "--random-output-len", "25")
    assert result.exit_code == 0, result.output
    assert fake_server.state.max_in_flight >= 3  # each stream lasts 100 ms: they overlap
    fake_server.state.reset()
    result = _invoke("serve", "--base-url", fake_server.base_url, "--num-prompts", "6", "--request-rate", "20",
                     "--seed", "5", "--random-input-len", "4", "--random-output-len", "2")
    assert result.exit_code == 0, result.output
    arrivals = fake_server.state.arrival_times
    gaps = random.Random(5 + 1)  # the client's arrival generator: seed + 1
    expected_spread = sum(gaps.expovariate(20.0) for _ in range(5))
    # the client sleeps exactly these gaps; the first request's own transit may eat a little of it
    assert arrivals[-1] - arrivals[0] >= 0.6 * expected_spread > 0.1


def test_serve_save_result_without_matplotlib_fails_before_sending(fake_server, tmp_path, monkeypatch):
    fake_server.state.reset()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    result = _invoke("serve", "--base-url", fake_server.base_url, "--num-prompts", "2",
                     "--save-result", "--result-dir", tmp_path)
    assert result.exit_code == 1
    assert "pip install 'weir-engine[bench]'" in result.output
    assert fake_server.state.bodies == []


@pytest.mark.parametrize("args, message", [
    (["--request-rate", "fast"], "--request-rate must be"),
    (["--request-rate", "0"], "--request-rate must be"),
    (["--endpoint", "/v1/embeddings"], "--endpoint must be one of"),
    (["--result-dir", "out"], "need --save-result"),
])
def test_serve_rejects_bad_options(fake_server, args, message):
    result = _invoke("serve", "--base-url", fake_server.base_url, *args)
    assert result.exit_code == 1 and message in result.output


def test_serve_unreachable_server_is_a_clear_error():
    result = _invoke("serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--timeout", "5")
    assert result.exit_code == 1 and "cannot reach http://127.0.0.1:9" in result.output


def test_chat_chunks_with_empty_content_are_token_arrivals():
    """As for completions: a chunk may carry a token whose text is not whole yet. Only the role
    announcement and a closing chunk carry none."""
    from weir.cli.bench.serve_client import _token_text

    assert _token_text({"delta": {"role": "assistant", "content": ""}}, is_chat=True) is None
    assert _token_text({"delta": {}, "finish_reason": "stop"}, is_chat=True) is None
    assert _token_text({"delta": {"content": ""}}, is_chat=True) == ""
    assert _token_text({"delta": {"content": "hi"}}, is_chat=True) == "hi"
    assert _token_text({"text": ""}, is_chat=False) == ""
    assert _token_text({"text": "", "finish_reason": "length"}, is_chat=False) is None


class _FailingImport:
    """A meta-path finder that makes importing ``names`` raise ``error`` (not only ImportError)."""

    def __init__(self, names: set[str], error: Exception):
        self.names, self.error = names, error

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            raise self.error
        return None


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'truststore'"),
                                   AttributeError("half-installed")])
def test_serve_falls_back_to_httpx_when_httpx2_is_broken(monkeypatch, error):
    """httpx2 imports without its transport (httpcore2, which needs truststore): it must count
    as missing then, whatever its import raises, and httpx serve instead."""
    from weir.cli.bench.serve_client import http_module

    fake_httpx = types.ModuleType("httpx")
    for name in ("httpcore2", "httpx", "httpcore"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "httpx", fake_httpx)
    monkeypatch.setitem(sys.modules, "httpcore", types.ModuleType("httpcore"))
    monkeypatch.setattr(sys, "meta_path", [_FailingImport({"httpcore2"}, error), *sys.meta_path])
    assert http_module() is fake_httpx
    monkeypatch.setitem(sys.modules, "httpx", None)  # neither works: the error names both
    with pytest.raises(RuntimeError, match=r"pip install httpx \(httpx2: .*; httpx: "):
        http_module()
