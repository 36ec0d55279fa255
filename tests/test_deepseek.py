"""DeepSeek-V3, DeepSeek-V3.2 and GLM-5 against transformers, fp32 on the CPU
(``weir.testing.transformers_greedy`` runs transformers with fla blocked): logits within 1e-4
relative and 32 identical greedy tokens for 8 prompts of 3 to 70 tokens, through chunked prefill
(16-token chunks: a chunk's queries see the latent and indexer keys of the earlier chunks from the
cache), prefix-cache hits and preemption.

The tiny checkpoints (tests/helpers_models.py): V3 with q LoRA, grouped routing with a non-zero
correction bias, a dense first layer and YaRN; V3 without q LoRA (``q_proj``), with attention
biases, two shared experts and rotate_half RoPE; V3.2 and GLM-5 with ``index_topk=8``, far below
the prompts, so queries attend to 8 of up to 100 keys; GLM-5 also with "shared" layers, which
attend to the keys the last "full" layer before them picked."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine_harness import assert_nothing_held, watch_engine
from helpers_models import make_tiny_deepseek_v3, make_tiny_deepseek_v32, make_tiny_glm_moe_dsa
from weir import LLM, SamplingParams
from weir.testing import transformers_greedy

pytestmark = pytest.mark.integration

NUM_TOKENS = 32
MAKERS = {
    "v3": make_tiny_deepseek_v3,
    "v3_no_q_lora": lambda path, **kw: make_tiny_deepseek_v3(path, q_lora_rank=None, n_shared_experts=2,
                                                             attention_bias=True, rope_interleave=False, **kw),
    "v32": make_tiny_deepseek_v32,
    "glm_moe_dsa": make_tiny_glm_moe_dsa,
    # Layers 1, 3 and 4 reuse the top-k of the last "full" layer before them (0, 2 and 2).
    "glm_moe_dsa_shared": lambda path, **kw: make_tiny_glm_moe_dsa(
        path, num_hidden_layers=5, indexer_types=["full", "shared", "full", "shared", "shared"], **kw),
}


def distinct_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for length in (3, 9, 17, 24, 31, 40, 55, 70)]


def shared_prefix_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(0, 256) for _ in range(37)]
    return [prefix[: 16 + 3 * i] + [rng.randrange(0, 256) for _ in range(1 + i)] for i in range(8)]


_CHECKPOINTS: dict = {}


def checkpoint(name: str, tmp_path_factory):
    """Each tiny checkpoint and transformers' greedy run of both prompt sets, once per session."""
    if name not in _CHECKPOINTS:
        path = MAKERS[name](tmp_path_factory.mktemp(name), with_tokenizer=True)
        prompts = distinct_prompts() + shared_prefix_prompts()
        results = transformers_greedy(path, prompts, NUM_TOKENS)
        _CHECKPOINTS[name] = path, {tuple(prompt): result for prompt, result in zip(prompts, results)}
    return _CHECKPOINTS[name]


def bytes_for_blocks(llm_probe: LLM, num_blocks: int) -> int:
    caches = llm_probe.engine.runner.caches
    return num_blocks * sum(caches.bytes_per_block(group) for group in caches.groups)


SCENARIOS = {
    "chunked_prefill": (dict(max_num_batched_tokens=16, block_size=4), distinct_prompts),
    "prefix_cache": (dict(block_size=4, enable_prefix_caching=True), shared_prefix_prompts),
    "preemption": (dict(block_size=4, max_model_len=128), distinct_prompts),
}
CASES = ([(name, scenario, True, False) for name in MAKERS for scenario in SCENARIOS]
         + [("v32", "chunked_prefill", False, False), ("v32", "preemption", False, False),
            ("v32", "chunked_prefill", True, True), ("v3", "prefix_cache", True, True)])


@pytest.mark.parametrize("name, scenario, async_scheduling, absorbed", CASES)
def test_matches_transformers(name, scenario, async_scheduling, absorbed, tmp_path_factory, monkeypatch):
    """``absorbed``: the reference backend in its absorbed form (MQA over the latent)."""
    from weir.plugins.attention.mla_torch import TorchMLABackend

    monkeypatch.setattr(TorchMLABackend, "absorbed", absorbed)
    path, expected = checkpoint(name, tmp_path_factory)
    options, make_prompts = SCENARIOS[scenario]
    options = dict(options)
    if scenario == "preemption":
        probe = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=128)
        # 40 usable blocks of 4 tokens: far less than 8 requests of up to 102 tokens need.
        options["kv_cache_memory_bytes"] = bytes_for_blocks(probe, 41)
    llm = LLM(str(path), device="cpu", dtype="float32", async_scheduling=async_scheduling, **options)
    backends = llm.engine.runner.caches.backends
    assert [backend.name for backend in backends.values()] == ["mla_torch"]
    assert next(iter(backends)) == ("sparse_mla" if name in ("v32", "glm_moe_dsa", "glm_moe_dsa_shared") else "mla")
    watch = watch_engine(llm)
    prompts = make_prompts()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    scheduler = llm.engine.scheduler
    if scenario == "preemption":
        assert scheduler.num_preemptions > 0
    if scenario == "prefix_cache":
        assert scheduler.kv_cache.num_prefix_hits > 0
    if scenario == "chunked_prefill":
        assert watch.num_steps > NUM_TOKENS + 70 // 16  # prompts needed several chunks
    for output, prompt in zip(outputs, prompts):
        expected_tokens, expected_logits = expected[tuple(prompt)]
        assert output.outputs[0].token_ids == expected_tokens, f"request {output.request_id}"
        logits = torch.stack(watch.logits[output.request_id][:NUM_TOKENS])
        rel_err = ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item()
        assert rel_err < 1e-4, f"request {output.request_id}: max relative error {rel_err:.2e}"
    assert_nothing_held(llm)


def test_the_sparsity_shows_in_the_reference(tmp_path_factory, tmp_path):
    """Guards the V3.2 parity: transformers' own logits with index_topk=8 are far from those of
    the same weights attending densely (index_topk above every length)."""
    path, expected = checkpoint("v32", tmp_path_factory)
    dense_path = tmp_path / "dense"
    shutil.copytree(path, dense_path)
    config = json.loads((dense_path / "config.json").read_text())
    config["index_topk"] = 4096
    (dense_path / "config.json").write_text(json.dumps(config))
    prompts = distinct_prompts()[-3:]
    for prompt, (_, dense_logits) in zip(prompts, transformers_greedy(dense_path, prompts, 4)):
        sparse_logits = expected[tuple(prompt)][1][:4]
        assert ((sparse_logits - dense_logits).abs().max() / dense_logits.abs().max()).item() > 1e-2
