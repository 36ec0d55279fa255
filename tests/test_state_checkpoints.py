"""The prefix cache's linear-attention state checkpoints, host side: the retention rule, the
checkpoint pool (pending until the step's copies are taken, LRU eviction, invariants that catch a
leak), and the KV manager and scheduler planning chunk ends, saves and loads; the device copies;
the option's validation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from weir.config import EngineArgs, SchedulerConfig
from weir.kv_cache import GroupConfig, KVCacheManager
from weir.kv_cache.block_pool import NULL_BLOCK_ID
from weir.kv_cache.retention import retained_boundaries
from weir.kv_cache.state_checkpoints import CheckpointPool
from weir.linear_attention import LayerState, copy_state_slots
from weir.request import Request, RequestStatus
from weir.sampling_params import SamplingParams
from weir.scheduler import Scheduler

BLOCK = 4
PROMPT = list(range(100, 137))  # 37 tokens: the last boundary before its last token is 36


def make_request(request_id: str, token_ids, max_tokens: int = 4) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens), frozenset(), max_tokens, seed=0)


def hybrid_manager(num_checkpoints: int = 8, interval: int | None = 0, num_blocks: int = 64,
                   window: int | None = None) -> KVCacheManager:
    groups = [GroupConfig(num_blocks)] + ([GroupConfig(num_blocks, window)] if window else [])
    return KVCacheManager(BLOCK, groups, enable_prefix_caching=True, num_state_slots=4,
                          num_checkpoint_slots=num_checkpoints, retention_interval=interval)


def admit(manager: KVCacheManager, request: Request, budget: int = 1000) -> tuple[int, int]:
    """Admit as the scheduler does: (hit tokens, tokens scheduled)."""
    hits, num_hit = manager.get_computed_blocks(request)
    num_new = manager.end_chunk_at_checkpoint(request, num_hit, min(request.num_tokens - num_hit, budget))
    assert manager.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens = num_hit + num_new
    return num_hit, num_new


def step(manager: KVCacheManager, request: Request, budget: int = 1000) -> int:
    """One more chunk of a running request."""
    num_new = manager.end_chunk_at_checkpoint(request, request.num_computed_tokens,
                                              min(request.num_tokens - request.num_computed_tokens, budget))
    assert manager.allocate_slots(request, num_new) is not None
    request.num_computed_tokens += num_new
    return num_new


def kept_boundaries(manager: KVCacheManager, request: Request) -> list[int]:
    hashes = request.update_block_hashes(BLOCK)
    return [(index + 1) * BLOCK for index, block_hash in enumerate(hashes)
            if manager.checkpoints.pool.lookup(block_hash) is not None]


# ---- the retention rule -------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,interval,junction,expected", [
    (37, 0, 0, (36,)),  # the last boundary before the last token
    (36, 0, 0, (32,)),  # ... so the same prompt sent again hits too
    (37, 0, 16, (16, 36)),  # and the junction with a cached prefix
    (37, 0, 36, (36,)),
    (37, 8, 16, (8, 16, 24, 32, 36)),  # every 8 tokens, the last boundary; no junctions
    (37, None, 0, tuple(range(4, 37, 4))),  # dense
    (5, 0, 0, (4,)),
    (4, 0, 0, ()),  # shorter than a block and a token: nothing to keep
])
def test_retained_boundaries(num_tokens, interval, junction, expected):
    assert retained_boundaries(num_tokens, BLOCK, interval, junction) == expected


# ---- the pool -----------------------------------------------------------------------------

def test_a_checkpoint_is_hittable_only_once_its_step_is_taken_and_the_coldest_is_evicted():
    pool = CheckpointPool(2)
    a = pool.reserve(b"a")
    assert pool.lookup(b"a") is None and pool.contains(b"a")  # its save has not run yet
    pool.check_invariants(between_steps=False)
    with pytest.raises(AssertionError, match="pending between steps"):
        pool.check_invariants()
    pool.commit()
    assert pool.lookup(b"a") == a
    b = pool.reserve(b"b")
    pool.commit()
    pool.touch(a)  # a hit: b is now the coldest
    c = pool.reserve(b"c")
    assert c == b and pool.lookup(b"b") is None and pool.lookup(b"a") == a and pool.num_evicted == 1
    assert pool.reserve(b"d") == a  # a was the only queued slot left
    assert pool.reserve(b"e") is None  # every slot pending in this step
    pool.commit()
    assert pool.num_cached == 2 and pool.num_saved == 4
    with pytest.raises(ValueError, match="kept already"):
        pool.reserve(b"c")
    pool.reset()
    assert pool.num_cached == 0 and pool.lookup(b"c") is None
    pool.check_invariants()
    with pytest.raises(ValueError, match="at least 1 slot"):
        CheckpointPool(0)


def test_pool_invariants_catch_a_lost_and_a_confused_slot():
    pool = CheckpointPool(3)
    pool.reserve(b"a")
    pool.commit()
    del pool.queue[2]  # lost
    with pytest.raises(AssertionError, match="lost"):
        pool.check_invariants()
    pool.queue[2] = None
    pool.slot_hash[2] = b"stale"  # a hash no map knows
    with pytest.raises(AssertionError, match="have a hash"):
        pool.check_invariants()


# ---- the manager --------------------------------------------------------------------------

def test_a_prefill_ends_at_the_last_boundary_whose_state_is_then_saved_and_loaded_by_a_later_hit():
    manager = hybrid_manager()
    first = make_request("a", PROMPT)
    assert admit(manager, first) == (0, 36)  # the chunk ends at 36 so the state there can be saved
    copies = manager.take_state_copies()
    assert copies.loads == [] and len(copies.saves) == 1 and copies.saves[0][0] == first.state_slot
    checkpoint = copies.saves[0][1]
    assert step(manager, first) == 1 and manager.take_state_copies() is None
    manager.check_invariants()

    second = make_request("b", PROMPT + [7, 8])
    assert admit(manager, second) == (36, 3)
    copies = manager.take_state_copies()
    assert copies.loads == [(checkpoint, second.state_slot)] and copies.saves == []  # 36 is kept already
    full_a, = manager.block_ids(first)
    assert manager.block_ids(second)[0][:9] == full_a[:9]
    manager.check_invariants()
    for request in (first, second):
        manager.free(request)
    manager.check_invariants(idle=True)


def test_a_request_admitted_in_the_same_step_cannot_hit_a_state_not_saved_yet():
    manager = hybrid_manager()
    first, second = make_request("a", PROMPT), make_request("b", PROMPT + [7])
    admit(manager, first)
    assert admit(manager, second) == (0, 38)  # no hit; 36 is saved already (by first): no chunk end there
    copies = manager.take_state_copies()
    assert [state_slot for state_slot, _ in copies.saves] == [first.state_slot]
    third = make_request("c", PROMPT + [9])
    assert admit(manager, third)[0] == 36


def test_the_junction_with_a_cached_prefix_is_kept_and_hit_by_the_next_request_sharing_it():
    manager = hybrid_manager()
    first = make_request("a", PROMPT)
    admit(manager, first)
    step(manager, first)
    manager.take_state_copies()
    branch = make_request("b", PROMPT[:18] + [1, 2, 3, 4, 5, 6])  # shares 18 tokens: 4 whole blocks
    assert admit(manager, branch) == (0, 16)  # nothing kept at 16 yet: compute it, end the chunk there
    manager.take_state_copies()
    assert step(manager, branch) == 4 and kept_boundaries(manager, branch) == [16]  # 20: after this step
    manager.take_state_copies()
    assert kept_boundaries(manager, branch) == [16, 20] and kept_boundaries(manager, first) == [16, 36]
    again = make_request("c", PROMPT[:17] + [9, 9, 9])
    assert admit(manager, again)[0] == 16
    manager.take_state_copies()
    manager.check_invariants()


@pytest.mark.parametrize("interval,kept,chunks", [
    (0, [36], [36, 1]),
    (8, [8, 16, 24, 32, 36], [8, 8, 8, 8, 4, 1]),
    (4, list(range(4, 37, 4)), [4] * 9 + [1]),
])
def test_the_retention_interval_decides_where_a_prompt_keeps_its_state(interval, kept, chunks):
    manager = hybrid_manager(num_checkpoints=16, interval=interval)
    request = make_request("a", PROMPT)
    sizes = [admit(manager, request)[1]]
    manager.take_state_copies()
    while request.num_computed_tokens < request.num_tokens:
        sizes.append(step(manager, request))
        manager.take_state_copies()
        manager.check_invariants()
    assert sizes == chunks and kept_boundaries(manager, request) == kept


def test_a_tiny_pool_evicts_the_least_recently_used_checkpoint():
    manager = hybrid_manager(num_checkpoints=2)
    prompts = {name: [ord(name) * 100 + i for i in range(13)] for name in "abc"}  # each keeps 12

    def run(request_id: str, token_ids: list[int]) -> int:
        request = make_request(request_id, token_ids)
        num_hit, _ = admit(manager, request)
        manager.take_state_copies()
        manager.free(request)
        return num_hit

    assert run("a", prompts["a"]) == 0 and run("b", prompts["b"]) == 0
    assert run("a2", prompts["a"] + [1]) == 12  # a hit refreshes a
    run("c", prompts["c"])
    assert run("b2", prompts["b"] + [1]) == 0  # b was the coldest
    assert manager.checkpoints.pool.num_evicted == 2  # b, then a (b2 saved its own 12)
    manager.check_invariants()


def test_more_saves_in_one_step_than_checkpoint_slots_skips_the_extra_ones():
    manager = hybrid_manager(num_checkpoints=1)
    for name in "ab":
        admit(manager, make_request(name, [ord(name)] * 9))
    copies = manager.take_state_copies()
    assert len(copies.saves) == 1
    manager.check_invariants()


def test_invariants_catch_a_pending_checkpoint_no_save_writes():
    manager = hybrid_manager()
    admit(manager, make_request("a", PROMPT))
    manager.checkpoints.step.saves.clear()
    with pytest.raises(AssertionError, match="this step saves into"):
        manager.check_invariants()


def test_hybrid_prefix_caching_needs_checkpoint_slots_and_a_valid_interval():
    with pytest.raises(ValueError, match="needs at least one state checkpoint slot"):
        hybrid_manager(num_checkpoints=0)
    with pytest.raises(ValueError, match="multiple of the block size 4, got 6"):
        hybrid_manager(interval=6)


def test_windowed_blocks_outside_every_retained_window_lose_their_hash_when_freed():
    """Window 5, retention 0: a 24-token prompt keeps the window of its boundary 20 (block 4);
    the other windowed blocks become free and are reused first. Dense retention keeps them all."""
    window = 5
    for interval, expect_kept, expect_hit in ((0, {4}, 20), (None, {0, 1, 2, 3, 4, 5}, 24)):
        manager = KVCacheManager(BLOCK, [GroupConfig(64), GroupConfig(64, window)], enable_prefix_caching=True,
                                 retention_interval=interval)
        request = make_request("a", range(24))
        admit(manager, request)
        windowed = manager.block_ids(request)[1]
        manager.free(request)
        pool = manager.pools[1]
        assert {index for index, block in enumerate(windowed) if pool.block_hash[block] is not None} == expect_kept
        dropped = [block for index, block in enumerate(windowed) if index not in expect_kept]
        assert set(list(pool.free_queue)[: len(dropped)]) == set(dropped)  # reused before any cached block
        again = make_request("b", list(range(24)) + [9])
        assert manager.get_computed_blocks(again)[1] == expect_hit
        manager.check_invariants()


def test_a_window_block_another_holder_retains_keeps_its_hash():
    manager = KVCacheManager(BLOCK, [GroupConfig(64), GroupConfig(64, 5)], enable_prefix_caching=True,
                             retention_interval=0)
    first = make_request("a", range(13))  # keeps the window of 12: windowed block 2
    admit(manager, first)
    second = make_request("b", list(range(13)) + [50] * 12)  # hits 12, then runs past it
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 12 and hits[1] == [NULL_BLOCK_ID] * 2 + manager.block_ids(first)[1][2:3]
    manager.allocate_slots(second, 13, hits)
    manager.free(first)  # second still holds block 2
    shared = manager.block_ids(second)[1][2]
    second.num_computed_tokens = 25
    manager.free(second)  # second's own retained boundary is 24: block 2 is not in its window
    assert manager.pools[1].block_hash[shared] is not None  # first retained it
    manager.check_invariants(idle=True)


# ---- the scheduler ------------------------------------------------------------------------

def test_the_scheduler_ends_the_chunk_at_the_boundary_and_ships_the_copies():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, async_scheduling=False)
    scheduler = Scheduler(config, hybrid_manager())
    scheduler.add_request(make_request("a", PROMPT))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 36} and not out.sampling_req_ids
    assert out.state_copies.saves == [(scheduler.requests["a"].state_slot, out.state_copies.saves[0][1])]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and out.sampling_req_ids == {"a"} and out.state_copies is None
    scheduler.add_request(make_request("b", PROMPT + [5]))
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"b": 2} and out.new_reqs[0].num_computed_tokens == 36
    assert out.state_copies.loads == [(out.state_copies.loads[0][0], out.new_reqs[0].state_slot)]
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    scheduler.kv_cache.check_invariants(idle=True)


# ---- device copies and the option -------------------------------------------------------

def test_copy_state_slots_copies_every_slot_indexed_tensor():
    source = LayerState(torch.arange(24.0).view(4, 2, 3), torch.arange(32.0).view(4, 2, 2, 2))
    target = LayerState(torch.zeros(3, 2, 3), torch.zeros(3, 2, 2, 2))
    copy_state_slots(source, torch.tensor([3, 1]), target, torch.tensor([0, 2]))
    assert torch.equal(target.conv_state[0], source.conv_state[3]) and torch.equal(target.conv_state[2], source.conv_state[1])
    assert torch.equal(target.recurrent_state[[0, 2]], source.recurrent_state[[3, 1]])
    assert not target.conv_state[1].any()

    @dataclass
    class OtherKind:  # a state kind of a plugin, not a LayerState
        sums: torch.Tensor

    other = OtherKind(torch.zeros(2, 5))
    copy_state_slots(OtherKind(torch.ones(2, 5)), torch.tensor([1]), other, torch.tensor([0]))
    assert other.sums[0].sum() == 5 and other.sums[1].sum() == 0

    class Opaque:
        pass

    with pytest.raises(TypeError, match="Opaque holds no tensors to copy between state slots"):
        copy_state_slots(Opaque(), torch.tensor([0]), Opaque(), torch.tensor([0]))


@pytest.mark.parametrize("interval", [-16, 20])
def test_a_bad_retention_interval_is_named(interval):
    with pytest.raises(ValueError, match=rf"prefix_cache_retention_interval must be 0 or a positive multiple of "
                                         rf"block_size \(16\), got {interval}"):
        EngineArgs(prefix_cache_retention_interval=interval)._validate()


def test_the_option_is_a_cli_flag():
    from weir.cli.engine_options import engine_option_fields

    assert "prefix_cache_retention_interval" in {field.name for field in engine_option_fields()}
