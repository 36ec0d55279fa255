"""Sliding-window models against transformers, fp32 on the CPU: Granite SWA and GraniteMoe SWA
(a window of 5 tokens on three of four layers, much shorter than the prompts and the 32 greedy
tokens, a NoPE layer, two RoPE bases, random sinks, non-unit multipliers) through chunked
prefill, prefix-cache hits and preemption; a Mistral-style window on every layer and Qwen3's
windows from ``max_window_layers``; and the windowed group's memory, bounded by the window."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import assert_nothing_held, hf_greedy_with, watch_engine
from helpers_models import make_tiny_granite_swa, make_tiny_granitemoe_swa, make_tiny_mistral, make_tiny_qwen3
from weir import LLM, SamplingParams
from weir.kv_cache.block_pool import NULL_BLOCK_ID

pytestmark = pytest.mark.integration  # parity through the whole engine

NUM_TOKENS = 32
WINDOW = 5


MAKERS = {
    "granite_swa": make_tiny_granite_swa,
    "granitemoe_swa": make_tiny_granitemoe_swa,
    "granitemoe_swa_narrow_shared": lambda path, **kw: make_tiny_granitemoe_swa(path, shared_intermediate_size=24, **kw),
    "mistral": lambda path, **kw: make_tiny_mistral(path, sliding_window=WINDOW, **kw),
    # transformers builds layer_types from max_window_layers: layer 0 full, layer 1 windowed.
    "qwen3_windowed": lambda path, **kw: make_tiny_qwen3(path, use_sliding_window=True, sliding_window=WINDOW,
                                                         max_window_layers=1, **kw),
}


_CHECKPOINTS: dict = {}


def checkpoint(name: str, tmp_path_factory):
    """Each tiny checkpoint and its transformers model, built once per test session."""
    from transformers import AutoModelForCausalLM

    if name not in _CHECKPOINTS:
        path = MAKERS[name](tmp_path_factory.mktemp(name), with_tokenizer=True)
        _CHECKPOINTS[name] = path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return _CHECKPOINTS[name]


def distinct_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for length in (3, 9, 17, 24, 31, 40, 55, 70)]


def shared_prefix_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(0, 256) for _ in range(37)]
    return [prefix[: 16 + 3 * i] + [rng.randrange(0, 256) for _ in range(1 + i)] for i in range(8)]


def bytes_for_blocks(llm_probe: LLM, num_blocks: int) -> int:
    """KV bytes that give every cache group ``num_blocks`` blocks (each group's cap is larger)."""
    caches = llm_probe.engine.runner.caches
    return num_blocks * sum(caches.bytes_per_block(group) for group in caches.groups)


SCENARIOS = {
    # (engine options, prompts): each forces one mechanism.
    "chunked_prefill": (dict(max_num_batched_tokens=16, block_size=4), distinct_prompts),
    "prefix_cache": (dict(block_size=4, enable_prefix_caching=True), shared_prefix_prompts),
    "preemption": (dict(block_size=4, max_model_len=128), distinct_prompts),
}


# The Granite families run every scenario with and without async scheduling; the other windowed
# configs every scenario once. A model windowed on every layer holds only windows and prefill
# chunks, so no small pool preempts it without refusing a lone max_model_len request: Mistral
# skips preemption (tests/test_kv_manager.py preempts a windowed group directly).
CASES = ([(name, scenario, async_scheduling) for name in ("granite_swa", "granitemoe_swa")
          for scenario in sorted(SCENARIOS) for async_scheduling in (True, False)]
         + [(name, scenario, True) for name in ("granitemoe_swa_narrow_shared", "mistral", "qwen3_windowed")
            for scenario in sorted(SCENARIOS) if (name, scenario) != ("mistral", "preemption")])


@pytest.mark.parametrize("name, scenario, async_scheduling", CASES)
def test_matches_transformers(name, scenario, async_scheduling, tmp_path_factory):
    path, hf_model = checkpoint(name, tmp_path_factory)
    options, make_prompts = SCENARIOS[scenario]
    options = dict(options)
    if scenario == "preemption":
        probe = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=128)
        # 40 usable blocks of 4 tokens in each group: far less than 8 requests of up to 102 tokens need.
        options["kv_cache_memory_bytes"] = bytes_for_blocks(probe, 41)
    llm = LLM(str(path), device="cpu", dtype="float32", async_scheduling=async_scheduling, **options)
    assert {group.sliding_window for group in llm.engine.runner.caches.groups} >= {WINDOW}
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
        assert completion.token_ids == expected_tokens, f"request {output.request_id}"
        logits = torch.stack(watch.logits[output.request_id][:NUM_TOKENS])
        rel_err = ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item()
        assert rel_err < 1e-4, f"request {output.request_id}: max relative error {rel_err:.2e}"
    assert_nothing_held(llm)


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_long_decode_holds_only_the_windows_blocks(tmp_path, block_size):
    """Decoding far past the window, the request never holds more than ceil(W / block_size) + 1
    blocks of the windowed group, while the full-attention group keeps every block."""
    path = make_tiny_granite_swa(tmp_path, with_tokenizer=True)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=block_size, max_model_len=512)
    engine = llm.engine
    kv_cache = engine.scheduler.kv_cache
    full, windowed = (0, 1) if kv_cache.groups[0].sliding_window is None else (1, 0)
    assert kv_cache.groups[windowed].sliding_window == WINDOW
    engine.add_request("r", {"prompt_token_ids": list(range(60))},
                       SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    bound = -(-WINDOW // block_size) + 1
    decode_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.requests.get("r")
        if request is None:  # finished: the step after it gives its row back
            continue
        blocks = kv_cache.block_ids(request)
        held = [block for block in blocks[windowed] if block != NULL_BLOCK_ID]
        if request.num_computed_tokens > 60:  # decoding
            decode_steps += 1
            assert len(held) <= bound, f"{len(held)} windowed blocks at {request.num_computed_tokens} tokens"
        assert len(blocks[full]) == -(-request.num_computed_tokens // block_size)
        kv_cache.check_invariants()
    assert decode_steps > 250
    assert_nothing_held(llm)


def test_the_window_saves_memory_per_request(tmp_path):
    """With the same budget, the windowed group caps at what its requests' windows can use and
    the full-attention group gets the rest: more tokens than if every layer were full."""
    options = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=2**20, max_num_seqs=8, max_model_len=256,
                   max_num_batched_tokens=64, block_size=4)
    windowed = LLM(str(make_tiny_granite_swa(tmp_path / "windowed", with_tokenizer=True)), **options)
    as_full = LLM(str(make_tiny_granite_swa(tmp_path / "full", layer_types=["full_attention"] * 4,
                                            with_tokenizer=True)), **options)
    sizes = {group.sliding_window: blocks for group, blocks in zip(windowed.engine.runner.caches.groups,
                                                                   windowed.engine.runner.num_blocks)}
    # Capped: 8 requests' windows (2 blocks each, one more across a boundary) plus one step's 16 blocks.
    assert sizes[WINDOW] == 8 * 3 + 64 // 4 + 1
    assert sizes[None] == 8 * 256 // 4 + 1  # every running request at max_model_len
    assert as_full.engine.runner.num_blocks == [2**20 // (4 * 2 * 4 * 2 * 16 * 4)]  # 4 full layers share the budget
    assert sizes[None] > 2 * as_full.engine.runner.num_blocks[0]
