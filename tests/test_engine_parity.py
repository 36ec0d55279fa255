"""Weir against transformers, fp32 on the CPU: logits and 32 greedy tokens for a batch of 8
prompts of different lengths, through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from helpers_models import make_tiny_llama, make_tiny_qwen3
from engine_harness import assert_nothing_held, hf_greedy_with, watch_engine
from weir import LLM, SamplingParams

pytestmark = pytest.mark.integration

NUM_TOKENS = 32
MAKERS = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param), with_tokenizer=True)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def distinct_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for length in (3, 9, 17, 24, 31, 40, 55, 70)]


def shared_prefix_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(0, 256) for _ in range(37)]
    return [prefix[: 16 + 3 * i] + [rng.randrange(0, 256) for _ in range(1 + i)] for i in range(8)]


SCENARIOS = {
    # (engine options, prompts): each forces one mechanism.
    "chunked_prefill": (dict(max_num_batched_tokens=16), distinct_prompts),
    "prefix_cache": (dict(block_size=4), shared_prefix_prompts),
    "preemption": (dict(block_size=4, max_model_len=128, kv_cache_memory_bytes=None), distinct_prompts),
}


def kv_bytes_for_blocks(path, num_blocks: int, block_size: int) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_block = 2 * block_size * config.num_key_value_heads * head_dim * 4 * config.num_hidden_layers
    return num_blocks * per_block


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_matches_transformers(checkpoint, scenario, async_scheduling):
    path, hf_model = checkpoint
    options, make_prompts = SCENARIOS[scenario]
    options = dict(options)
    if scenario == "preemption":
        # 40 usable blocks of 4 tokens: far less than 8 requests of up to 102 tokens need.
        options["kv_cache_memory_bytes"] = kv_bytes_for_blocks(path, 41, 4)
    llm = LLM(str(path), device="cpu", dtype="float32", async_scheduling=async_scheduling, **options)
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
        expected_tokens, expected_logits = hf_greedy_with(hf_model, prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens
        assert completion.finish_reason == "length"
        logits = torch.stack(watch.logits[output.request_id][:NUM_TOKENS])
        rel_err = ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item()
        assert rel_err < 1e-4, f"request {output.request_id}: max relative error {rel_err:.2e}"
    assert_nothing_held(llm)
