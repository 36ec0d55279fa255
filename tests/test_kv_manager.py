"""The KV manager over several cache groups: window freeing, prefix hits that every group can
resume from, all-or-nothing allocation, and the invariant checks (which must catch a leak)."""

from __future__ import annotations

import pytest

from weir.config import SchedulerConfig
from weir.kv_cache import GroupConfig, KVCacheManager
from weir.kv_cache.block_pool import NULL_BLOCK_ID
from weir.request import Request
from weir.sampling_params import SamplingParams
from weir.scheduler import Scheduler
from weir.scheduler.scheduler import SampledTokens

BLOCK = 4
WINDOW = 5  # the query at p sees p - 4 .. p: it needs the blocks from (p - 4) // 4 on


def make_request(request_id: str, token_ids: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens), frozenset(), max_tokens, seed=0)


def run_chunk(manager: KVCacheManager, request: Request, num_tokens: int, hits=None) -> tuple[list[int], ...]:
    """Allocate a chunk as the scheduler does, then count it computed."""
    appended = manager.allocate_slots(request, num_tokens, hits)
    assert appended is not None
    if hits is not None:
        request.num_computed_tokens += len(hits[0]) * BLOCK
    request.num_computed_tokens += num_tokens
    return appended


def live(block_ids: list[int]) -> list[int]:
    return [block for block in block_ids if block != NULL_BLOCK_ID]


def test_a_windowed_group_frees_the_blocks_before_the_next_querys_window():
    manager = KVCacheManager(BLOCK, [GroupConfig(64), GroupConfig(64, WINDOW)], enable_prefix_caching=False)
    request = make_request("a", range(12))
    run_chunk(manager, request, 12)  # positions 0..11: three blocks in each group
    full, windowed = manager.block_ids(request)
    assert len(full) == len(windowed) == 3 and NULL_BLOCK_ID not in windowed
    request.output_token_ids.append(7)
    run_chunk(manager, request, 1)  # the query at 12 reads 8..12: blocks 0 and 1 go
    full, windowed = manager.block_ids(request)
    assert windowed[:2] == [NULL_BLOCK_ID] * 2 and len(live(windowed)) == 2 and len(full) == 4
    assert manager.pools[1].num_free_blocks == 63 - 2 and manager.pools[0].num_free_blocks == 63 - 4
    manager.check_invariants()
    manager.free(request)
    manager.check_invariants(idle=True)


def test_a_prefix_hit_takes_only_the_window_of_a_windowed_group():
    manager = KVCacheManager(BLOCK, [GroupConfig(64), GroupConfig(64, WINDOW)], enable_prefix_caching=True)
    first = make_request("a", range(20))
    run_chunk(manager, first, 20)
    first_full, first_windowed = manager.block_ids(first)
    second = make_request("b", list(range(20)) + [99])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 20  # 5 full blocks; the query at 20 reads 16..20: windowed block 4 only
    assert hits == (first_full[:5], [NULL_BLOCK_ID] * 4 + first_windowed[4:5])
    run_chunk(manager, second, 1, hits)
    assert manager.pools[0].ref_counts[first_full[0]] == 2 and manager.pools[1].ref_counts[first_windowed[4]] == 2
    manager.check_invariants()
    manager.free(first)
    manager.free(second)
    manager.check_invariants(idle=True)


def test_a_hit_shrinks_to_where_every_group_still_has_its_window():
    """The full group still caches the whole prefix, but the windowed group lost its last blocks
    to eviction: the hit ends where the windowed group can resume."""
    manager = KVCacheManager(BLOCK, [GroupConfig(64), GroupConfig(8, WINDOW)], enable_prefix_caching=True)
    first = make_request("a", range(24))
    run_chunk(manager, first, 24)
    manager.free(first)  # cached, evictable; freed tail first, so the tail is evicted first
    filler = make_request("f", range(1000, 1012))
    run_chunk(manager, filler, 12)  # 3 windowed blocks: the never-used one, then first's last two
    second = make_request("b", list(range(24)) + [5])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    # Windowed blocks 4 and 5 are gone: at 16 the window (12..16) needs block 3, which is cached.
    assert num_hit_tokens == 16 and len(hits[0]) == 4 and live(hits[1]) and hits[1][:3] == [NULL_BLOCK_ID] * 3
    manager.check_invariants()


def test_allocation_is_all_or_nothing_across_groups():
    manager = KVCacheManager(BLOCK, [GroupConfig(32), GroupConfig(3, WINDOW)], enable_prefix_caching=False)
    hog = make_request("hog", range(8))
    run_chunk(manager, hog, 8)  # both usable windowed blocks
    before = [list(pool.free_queue) for pool in manager.pools]
    other = make_request("b", range(100, 104))
    assert manager.allocate_slots(other, 4) is None  # the full group had room, the windowed one not
    assert [list(pool.free_queue) for pool in manager.pools] == before
    assert manager.block_ids(other) == ([], [])
    manager.check_invariants()


def test_the_invariant_check_catches_a_leaked_reference():
    manager = KVCacheManager(BLOCK, [GroupConfig(16), GroupConfig(16, WINDOW)], enable_prefix_caching=False)
    request = make_request("a", range(8))
    run_chunk(manager, request, 8)
    manager.check_invariants()
    manager.pools[1].ref_counts[manager.block_ids(request)[1][0]] += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="group 1: block"):
        manager.check_invariants()
    manager.pools[1].ref_counts[manager.block_ids(request)[1][0]] -= 1
    with pytest.raises(AssertionError, match="requests still hold blocks"):
        manager.check_invariants(idle=True)


def test_the_scheduler_preempts_when_a_windowed_group_runs_out():
    """Two requests decode past their first block; the full group has room for both, the
    windowed group (3 usable blocks) not: the newest is preempted, then resumes; every block
    comes back."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, async_scheduling=False)
    manager = KVCacheManager(BLOCK, [GroupConfig(64), GroupConfig(4, WINDOW)], enable_prefix_caching=False)
    scheduler = Scheduler(config, manager)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, range(4), max_tokens=6))
    finished = set()
    for _ in range(40):
        out = scheduler.schedule()
        manager.check_invariants()
        if out.is_empty and not scheduler.has_unfinished_requests():
            break
        sampled = SampledTokens(list(out.num_scheduled_tokens), [1] * len(out.num_scheduled_tokens))
        finished |= {update.request.request_id for update in scheduler.update(out, sampled) if update.finished}
    assert finished == {"a", "b"} and scheduler.num_preemptions > 0
    manager.check_invariants(idle=True)


def test_the_runner_hears_of_a_running_request_only_when_it_gets_blocks():
    """A decode step inside the last block appends nothing, so the step's output leaves the
    request out of ``cached_reqs``; the step that opens a block names it with that block."""
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64, async_scheduling=False)
    manager = KVCacheManager(BLOCK, [GroupConfig(16)], enable_prefix_caching=True)
    scheduler = Scheduler(config, manager)
    request = make_request("a", range(3), max_tokens=4)
    scheduler.add_request(request)
    appended, held = [], []
    for _ in range(3):  # the prompt (positions 0-2, block 0), then positions 3 (block 0) and 4 (block 1)
        out = scheduler.schedule()
        appended.append(dict(zip(out.cached_reqs.req_ids, out.cached_reqs.new_block_ids)))
        held.append(manager.block_ids(request)[0])
        scheduler.update(out, SampledTokens(list(out.num_scheduled_tokens), [1]))
    assert appended[:2] == [{}, {}] and held[1] == held[0] and len(held[0]) == 1
    assert appended[2] == {"a": ([held[2][1]],)} and len(held[2]) == 2


def test_the_idle_check_catches_a_block_nobody_gave_back():
    manager = KVCacheManager(BLOCK, [GroupConfig(16), GroupConfig(16, WINDOW)], enable_prefix_caching=True)
    request = make_request("a", range(8))
    run_chunk(manager, request, 8)
    with pytest.raises(AssertionError, match="requests still hold blocks"):
        manager.check_idle()
    manager.free(request)
    manager.check_idle()  # cached blocks count as back
    manager.pools[1].allocate(1)  # a block taken behind the manager's back
    with pytest.raises(AssertionError, match="group 1: 1 blocks held with no request running"):
        manager.check_idle()


def test_async_scheduling_frees_a_waiting_requests_window_before_the_next_chunk():
    """A request whose last prefill chunk already produced its last output slot is served nothing
    while that token is in flight; its chunk's blocks outside the window go back at once, so the
    next request's chunk fits (the windowed group is sized for one step's chunks)."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, async_scheduling=True)
    manager = KVCacheManager(BLOCK, [GroupConfig(64), GroupConfig(11, WINDOW)], enable_prefix_caching=False)
    scheduler = Scheduler(config, manager)
    scheduler.add_request(make_request("a", range(32), max_tokens=1))
    first = scheduler.schedule()  # a's whole prompt: 8 windowed blocks of 10 usable
    assert first.num_scheduled_tokens == {"a": 32}
    scheduler.add_request(make_request("b", range(100, 132), max_tokens=1))
    second = scheduler.schedule()  # a waits for its token; b needs 8 windowed blocks
    assert second.num_scheduled_tokens == {"b": 32}
    assert len(live(manager.block_ids(scheduler.requests["a"])[1])) <= 2
    manager.check_invariants()


def test_no_hit_without_a_cached_block():
    """Windows of one token need no prefix: an empty cache must still report no hit."""
    manager = KVCacheManager(BLOCK, [GroupConfig(16, 1)], enable_prefix_caching=True)
    assert manager.get_computed_blocks(make_request("a", range(20))) == (([],), 0)
