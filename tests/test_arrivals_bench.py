"""benchmarks/arrivals.py end to end on the CPU: every variant serves every request, the table
and the JSON say what ran."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "arrivals", Path(__file__).resolve().parents[1] / "benchmarks" / "arrivals.py")
arrivals = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arrivals)


def test_two_variants_serve_every_request(tiny_llama_path, tmp_path, capsys):
    result = tmp_path / "arrivals.json"
    code = arrivals.main([str(tiny_llama_path), "--rate", "200", "--num-prompts", "6", "--input-len", "40",
                          "--output-len", "3", "--max-model-len", "128", "--max-token-id", "200",
                          "--variant", 'chunks={"max_num_batched_tokens": 32}', "--output-json", str(result)])
    assert code == 0
    report = json.loads(result.read_text())["results"]
    assert list(report) == ["defaults", "chunks"] and report["chunks"]["options"] == {"max_num_batched_tokens": 32}
    for figures in report.values():
        assert figures["steps"] >= 3 and figures["mixed_steps"] >= 1
        assert figures["mixed_graph_replays"] == 0  # no graphs on the CPU
        assert 0 < figures["median_ttft_ms"] <= figures["p99_ttft_ms"]
    # Six 40-token prompts in 32-token chunks: at least 8 steps give some request more than one
    # token (a step whose only prompt piece is a single token counts as decode; even one such step
    # per prompt leaves 234 tokens, 8 steps of 32). How the defaults mix depends on arrival timing.
    assert report["chunks"]["mixed_steps"] >= 8
    assert "| chunks |" in capsys.readouterr().out


def test_a_variant_must_be_a_label_and_a_json_object():
    with pytest.raises(SystemExit):
        arrivals.main(["model", "--variant", "nolabel"])
    with pytest.raises(SystemExit):
        arrivals.main(["model", "--variant", "x=[1]"])
