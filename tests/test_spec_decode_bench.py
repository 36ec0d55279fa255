"""``benchmarks/spec_decode.py --workload ngram --vllm`` on the CPU, against a fake ``vllm``
package: the median of repeated timed runs, the draft counters per run, and whether each row's
greedy answers are Weir's without drafts (two engines' tok/s over different texts are not a race)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
SPEC_DECODE = ROOT / "benchmarks" / "spec_decode.py"

# What vllm_ngram_runs needs of vLLM. Every chat answers three tokens of 7 (never Weir's answer),
# and with drafts each chat call adds 10 draft and 5 accepted tokens to the counters.
# Each call is logged to $FAKE_VLLM_LOG (JSON lines).
FAKE_VLLM = '''
import json, os
from types import SimpleNamespace

__version__ = "0.0.0-fake"


def _log(event):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(event) + "\\n")


class SamplingParams:
    def __init__(self, **options):
        self.options = options


class LLM:
    def __init__(self, model, speculative_config=None, **options):
        self.spec = speculative_config
        self.drafts = 0
        _log({"event": "init", "speculative_config": speculative_config})

    def chat(self, prompts, params, use_tqdm=False):
        _log({"event": "chat", "prompts": len(prompts)})
        if self.spec:
            self.drafts += 1
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 7, 7])]) for _ in prompts]

    def reset_prefix_cache(self):
        _log({"event": "reset"})

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=10 * self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=5 * self.drafts)]
'''


@pytest.mark.integration
def test_ngram_rows_report_repeats_counters_and_whether_the_answers_agree(tmp_path):
    # The workload runs at max_model_len 1024, past the shared tiny model's 512 positions.
    model = make_tiny_llama(tmp_path / "model", with_tokenizer=True, max_position_embeddings=1024)
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "vllm.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]),
           "FAKE_VLLM_LOG": str(log)}
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(SPEC_DECODE), str(out), "--workload", "ngram", "--device", "cpu",
                    "--model", str(model), "--batch", "2", "--k", "2", "--repeats", "3",
                    "--output-len", "12", "--vllm"], env=env, check=True, timeout=600, cwd=ROOT)
    rows = json.loads((out / "spec-ngram.json").read_text())["rows"]

    weir = [r for r in rows if r["engine"] == "weir"]
    assert [r["k"] for r in weir] == [0, 2]
    for row in weir:
        assert row["repeats"] == 3 and row["fastest_s"] <= row["seconds"] <= row["slowest_s"]
        assert row["same_answers_as_weir_k0"] is True  # greedy n-gram drafts change no token
        assert row["tok_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
    assert "draft_tokens" not in weir[0] and {"draft_tokens", "accepted", "acceptance_rate"} <= weir[1].keys()

    vllm = [r for r in rows if r["engine"] != "weir"]
    assert [(r["engine"], r["k"]) for r in vllm] == [("vllm 0.0.0-fake", 0), ("vllm 0.0.0-fake", 2)]
    for row in vllm:
        assert "tokens" not in row
        assert row["same_answers_as_weir_k0"] is False
        assert row["output_tokens"] == 2 * 3 and row["repeats"] == 3
        weir_row = next(r for r in weir if r["k"] == row["k"])
        assert row["weir_over_vllm"] == pytest.approx(weir_row["tok_per_s"] / row["tok_per_s"])
    assert "draft_tokens" not in vllm[0]
    assert (vllm[1]["draft_tokens"], vllm[1]["accepted"], vllm[1]["acceptance_rate"]) == (10, 5, 0.5)  # per run

    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    # Per engine: one warm-up chat, then every timed run starts from an empty prefix cache.
    assert events == ["init", "chat"] + ["reset", "chat"] * 3 + ["init", "chat"] + ["reset", "chat"] * 3
    assert "same_answers_as_weir_k0" in (out / "spec-ngram.md").read_text()
