"""The KV block pool and manager on their own: states, LRU eviction, prefix hits, failed allocations."""

from __future__ import annotations

from weir.kv_cache import BlockPool, GroupConfig, KVCacheManager
from weir.kv_cache.block_pool import NULL_BLOCK_ID, hash_block
from weir.request import Request
from weir.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(), frozenset(), 100, 0)


def test_null_block_is_never_handed_out_and_free_order_is_lru():
    pool = BlockPool(num_blocks=5, enable_prefix_caching=True)
    blocks = pool.allocate(4)
    assert NULL_BLOCK_ID not in blocks and sorted(blocks) == [1, 2, 3, 4]
    pool.check_invariants(expected_in_use=4)
    pool.cache_full_block(blocks[0], b"h0")
    pool.free(blocks[:2])  # freed tail first: blocks[1] is evicted before blocks[0]
    pool.free(blocks[2:])
    # Queue: blocks[1], blocks[0] (cached), blocks[3], blocks[2]: least recently freed first.
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(b"h0") == blocks[0]
    pool.check_invariants(expected_in_use=1)
    assert pool.allocate(1) == [blocks[0]] and pool.lookup(b"h0") is None  # evicted: hash dropped
    assert pool.allocate(2) == [blocks[3], blocks[2]]
    pool.check_invariants(expected_in_use=4)


def test_hashes_are_deterministic_and_chained():
    assert hash_block(b"p", [1, 2]) == hash_block(b"p", [1, 2])
    assert hash_block(b"p", [1, 2]) != hash_block(b"q", [1, 2]) != hash_block(b"p", [2, 1])


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    manager = KVCacheManager(4, [GroupConfig(20)], enable_prefix_caching=True)
    first = make_request("a", list(range(12)))
    assert manager.allocate_slots(first, 12) is not None
    second = make_request("b", list(range(12)))  # same prompt: 3 full blocks, but 1 token to compute
    (hits,), num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8 and hits == manager.block_ids(first)[0][:2]
    manager.allocate_slots(second, 4, (hits,))
    assert manager.block_ids(second)[0][:2] == manager.block_ids(first)[0][:2]
    assert manager.pools[0].ref_counts[hits[0]] == 2
    manager.check_invariants()
    manager.free(first)
    manager.free(second)
    manager.check_invariants(idle=True)
    third = make_request("c", list(range(12)) + [99])
    assert manager.get_computed_blocks(third)[1] == 12  # cached free blocks still hit


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(4, [GroupConfig(4)], enable_prefix_caching=True)
    pool = manager.pools[0]
    request = make_request("a", list(range(8)))
    assert manager.allocate_slots(request, 8) is not None
    before = (manager.block_ids(request), list(pool.free_queue), list(pool.ref_counts))
    other = make_request("b", list(range(50, 58)))
    assert manager.allocate_slots(other, 8) is None
    assert manager.block_ids(other) == ([],)
    assert before == (manager.block_ids(request), list(pool.free_queue), list(pool.ref_counts))
    manager.check_invariants()
    pool.check_invariants(expected_in_use=2)
