"""Prefix caching of a hybrid model (tiny Qwen3-Next: Gated DeltaNet + full attention) against
transformers and a cache-off run, fp32 on the CPU. Requests sharing prefixes of every kind resume
their DeltaNet layers from state checkpoints, with the hit lengths asserted, through chunked
prefill, a tiny checkpoint pool, preemption and both scheduling modes; the allocators' invariants
are checked after every step. The retention interval decides what is kept, and sliding-window
groups (tiny Granite SWA) keep their window blocks by the same rule."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from engine_harness import assert_nothing_held, watch_engine
from helpers_models import make_tiny_granite_swa, make_tiny_qwen3_next
from weir import LLM, SamplingParams
from weir.testing import transformers_greedy

pytestmark = pytest.mark.integration

NUM_TOKENS = 12
BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(256) for _ in range(count)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3_next_prefix"), with_tokenizer=True)


@pytest.fixture(scope="module")
def cases(checkpoint):
    """Named prompts, the tokens they hit when run one after another in this order (block 4,
    retention 0), and transformers' greedy tokens and logits for each prompt."""
    rng = random.Random(3)
    base = random_tokens(rng, 37)  # keeps its state at 36
    (reply, _), = transformers_greedy(checkpoint, [base], NUM_TOKENS)
    sequence = [
        ("base", base, 0),
        ("shares less than a block", base[:2] + random_tokens(rng, 4), 0),
        ("shares up to a boundary", base[:16] + random_tokens(rng, 7), 0),  # keeps the junction 16 and 20
        ("shares the same boundary", base[:16] + random_tokens(rng, 5), 16),
        ("shares a block and a half more", base[:18] + random_tokens(rng, 3), 16),
        ("next turn: base, its reply, more", base + reply + random_tokens(rng, 6), 36),
        ("base again", base, 36),
    ]
    others = {
        "branch at 30": base[:30] + random_tokens(rng, 5),
        **{f"distinct {index}": random_tokens(rng, 13 + 4 * index) for index in range(3)},
        "distinct 0 again": None, "distinct 2 again": None,
    }
    others["distinct 0 again"] = others["distinct 0"] + random_tokens(rng, 2)
    others["distinct 2 again"] = others["distinct 2"] + random_tokens(rng, 2)
    prompts = {name: prompt for name, prompt, _ in sequence} | others
    references = dict(zip(prompts, transformers_greedy(checkpoint, list(prompts.values()), NUM_TOKENS)))
    return sequence, prompts, references


def hybrid_llm(checkpoint, **options) -> LLM:
    return LLM(str(checkpoint), device="cpu", dtype="float32", block_size=BLOCK, max_model_len=128, **options)


def run_one_by_one(llm: LLM, prompts: list[list[int]]):
    """Each prompt after the one before has finished, so each can hit what the others kept."""
    return [llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0] for prompt in prompts]


def assert_matches(watch, output, reference) -> None:
    expected_tokens, expected_logits = reference
    assert output.outputs[0].token_ids == expected_tokens
    logits = torch.stack(watch.logits[output.request_id][:NUM_TOKENS])
    rel_err = ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item()
    assert rel_err < 1e-4, f"request {output.request_id}: max relative error {rel_err:.2e}"


def kept_boundaries(llm: LLM, prompt: list[int]) -> list[int]:
    """The boundaries of ``prompt`` whose state the prefix cache keeps."""
    from weir.request import Request

    request = Request("probe", list(prompt), PARAMS, frozenset(), 1, seed=0)
    pool = llm.engine.scheduler.kv_cache.checkpoints.pool
    return [(index + 1) * BLOCK for index, block_hash in enumerate(request.update_block_hashes(BLOCK))
            if pool.lookup(block_hash) is not None]


@pytest.fixture(scope="module")
def cache_off_tokens(checkpoint, cases):
    sequence, _, _ = cases
    llm = hybrid_llm(checkpoint, enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": prompt} for _, prompt, _ in sequence], PARAMS, use_tqdm=False)
    assert all(output.num_cached_tokens == 0 for output in outputs)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("options", [
    dict(async_scheduling=True),
    dict(async_scheduling=False, max_num_batched_tokens=6),  # every prefill in chunks, across the checkpoints
], ids=["plain", "chunked_prefill"])
def test_shared_prefixes_match_transformers_and_a_cache_off_run(checkpoint, cases, cache_off_tokens, options):
    sequence, _, references = cases
    llm = hybrid_llm(checkpoint, **options)
    watch = watch_engine(llm)
    outputs = run_one_by_one(llm, [prompt for _, prompt, _ in sequence])
    assert [(name, output.num_cached_tokens) for (name, _, _), output in zip(sequence, outputs)] == [
        (name, hit) for name, _, hit in sequence]
    for (name, _, _), output in zip(sequence, outputs):
        assert_matches(watch, output, references[name])
    assert [output.outputs[0].token_ids for output in outputs] == cache_off_tokens
    kv_cache = llm.engine.scheduler.kv_cache
    assert kv_cache.num_prefix_hits == sum(hit for _, _, hit in sequence)  # what the metrics report
    base = sequence[0][1]
    assert kept_boundaries(llm, base) == [16, 36]  # 16: the junction the third request kept
    assert_nothing_held(llm)


@pytest.mark.parametrize("interval,kept,hit", [
    (0, [36], 0),  # the last boundary only; the branch computes from 0 (and keeps its junction 28)
    (8, [8, 16, 24, 32, 36], 24),
    (4, list(range(4, 37, 4)), 28),  # dense: every block
])
def test_the_retention_interval_decides_what_is_kept(checkpoint, cases, interval, kept, hit):
    _, prompts, references = cases
    llm = hybrid_llm(checkpoint, prefix_cache_retention_interval=interval)
    watch = watch_engine(llm)
    base, = run_one_by_one(llm, [prompts["base"]])
    assert kept_boundaries(llm, prompts["base"]) == kept
    branch, = run_one_by_one(llm, [prompts["branch at 30"]])
    assert branch.num_cached_tokens == hit
    assert_matches(watch, base, references["base"])
    assert_matches(watch, branch, references["branch at 30"])
    assert_nothing_held(llm)


def test_a_tiny_checkpoint_pool_evicts_the_coldest_and_stays_exact(checkpoint, cases, monkeypatch):
    from weir.runner import kv_sizing

    _, prompts, references = cases

    def two_checkpoints(budget, checkpoint_bytes, min_paged_bytes, split):
        return split(budget - 2 * checkpoint_bytes), 2

    monkeypatch.setattr(kv_sizing, "split_with_checkpoints", two_checkpoints)
    llm = hybrid_llm(checkpoint)
    assert llm.engine.scheduler.kv_cache.checkpoints.pool.num_slots == 2
    watch = watch_engine(llm)
    names = ["distinct 0", "distinct 1", "distinct 2", "distinct 0 again", "distinct 2 again"]
    outputs = run_one_by_one(llm, [prompts[name] for name in names])
    # Each distinct prompt keeps one checkpoint; the third evicts the first's.
    assert [output.num_cached_tokens for output in outputs] == [0, 0, 0, 0, 20]
    assert llm.engine.scheduler.kv_cache.checkpoints.pool.num_evicted >= 1
    for name, output in zip(names, outputs):
        assert_matches(watch, output, references[name])
    assert_nothing_held(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preempted_requests_resume_from_checkpoints(checkpoint, cases, async_scheduling):
    """A KV cache of 36 blocks (and 4 checkpoints) for 12 requests sharing prefixes, admitted a few
    at a time (a 16-token budget): requests are preempted after keeping checkpoints, and come back
    hitting them."""
    sequence, prompts, references = cases
    names = [name for name, _, _ in sequence] + ["branch at 30", "distinct 0", "distinct 1", "distinct 2", "base"]
    llm = hybrid_llm(checkpoint, max_num_batched_tokens=16, async_scheduling=async_scheduling,
                     kv_cache_memory_bytes=48 * 4096)  # a block of the two full layers is 4 KiB
    kv_cache = llm.engine.scheduler.kv_cache
    assert (kv_cache.pools[0].num_blocks, kv_cache.checkpoints.pool.num_slots) == (36, 4)
    resumed_hits = []
    lookup = kv_cache.get_computed_blocks

    def recording_lookup(request):
        blocks, num_hit = lookup(request)
        if request.num_preemptions:
            resumed_hits.append(num_hit)
        return blocks, num_hit

    kv_cache.get_computed_blocks = recording_lookup
    watch = watch_engine(llm)
    outputs = llm.generate([{"prompt_token_ids": prompts[name]} for name in names], PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0 and any(resumed_hits), resumed_hits
    assert kv_cache.num_prefix_hits > 0
    for name, output in zip(names, outputs):
        assert_matches(watch, output, references[name])
    assert_nothing_held(llm)


def test_no_room_for_a_checkpoint_turns_prefix_caching_off_and_says_so(checkpoint, cases, monkeypatch, caplog):
    from weir.runner import kv_sizing

    _, prompts, references = cases
    monkeypatch.setattr(kv_sizing, "split_with_checkpoints", lambda budget, size, minimum, split: (split(budget), 0))
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        llm = hybrid_llm(checkpoint)
    assert "prefix caching: off for Qwen3NextForCausalLM: the KV cache budget leaves no room" in caplog.text
    outputs = run_one_by_one(llm, [prompts["base"]] * 2)
    assert [output.num_cached_tokens for output in outputs] == [0, 0]
    assert [output.outputs[0].token_ids for output in outputs] == [references["base"][0]] * 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        hybrid_llm(checkpoint, enable_prefix_caching=False)
    assert "prefix caching: off" in caplog.text


@pytest.mark.parametrize("interval,hits", [(0, [0, 20, 0]), (4, [0, 20, 12])])
def test_window_blocks_follow_the_same_retention_rule(tmp_path, interval, hits, caplog):
    """Granite SWA (window 5): a 24-token prompt keeps the window of its boundary 20 (and, with
    interval 4, of every boundary); a prompt branching at 12 hits there only if that window was kept."""
    path = make_tiny_granite_swa(tmp_path / "granite", with_tokenizer=True)
    rng = random.Random(5)
    base = random_tokens(rng, 24)
    prompts = [base, base + random_tokens(rng, 3), base[:12] + random_tokens(rng, 6)]
    references = transformers_greedy(path, prompts, NUM_TOKENS)
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK, max_model_len=128,
                  prefix_cache_retention_interval=interval)
    assert f"windowed groups keep cached window blocks by the retention interval {interval}" in caplog.text
    watch = watch_engine(llm)
    outputs = run_one_by_one(llm, prompts)
    assert [output.num_cached_tokens for output in outputs] == hits
    for output, reference in zip(outputs, references):
        assert_matches(watch, output, reference)
    assert_nothing_held(llm)
