"""Weir vs transformers on the CPU in fp32: the figures behind tests/test_engine_parity.py.

    python3 tests/parity_report.py

Prints, per model and scenario (chunked prefill, prefix-cache hits, preemption), how many of the
8 prompts' 32 greedy tokens are identical and the largest relative logit error. It lives beside
the test whose scenarios it runs (run as a script, tests/ is on its import path); pytest does
not collect it.
"""

import pathlib
import tempfile

import torch
from transformers import AutoModelForCausalLM

from engine_harness import hf_greedy_with, watch_engine
from helpers_models import make_tiny_llama, make_tiny_qwen3
from test_engine_parity import SCENARIOS, kv_bytes_for_blocks
from weir import LLM, SamplingParams


def main() -> None:
    for name, maker in [("llama", make_tiny_llama), ("qwen3", make_tiny_qwen3)]:
        path = maker(pathlib.Path(tempfile.mkdtemp()), with_tokenizer=True)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for scenario, (options, make_prompts) in sorted(SCENARIOS.items()):
            options = dict(options)
            if scenario == "preemption":
                options["kv_cache_memory_bytes"] = kv_bytes_for_blocks(path, 41, 4)
            llm = LLM(str(path), device="cpu", dtype="float32", **options)
            watch = watch_engine(llm)
            prompts = make_prompts()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
            worst, identical = 0.0, 0
            for output, prompt in zip(outputs, prompts):
                tokens, logits = hf_greedy_with(hf_model, prompt, 32)
                identical += output.outputs[0].token_ids == tokens
                ours = torch.stack(watch.logits[output.request_id][:32])
                worst = max(worst, ((ours - logits).abs().max() / logits.abs().max()).item())
            scheduler = llm.engine.scheduler
            print(f"{name:6s} {scenario:16s} identical greedy: {identical}/8  max rel logit err {worst:.2e}  "
                  f"preemptions {scheduler.num_preemptions}  prefix-hit tokens {scheduler.kv_cache.num_prefix_hits}")


if __name__ == "__main__":
    main()
