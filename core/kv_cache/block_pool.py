"""The pool of KV cache blocks, with prefix caching on full blocks.

Every block is in exactly one of three states (the invariant ``check_invariants`` asserts):
- in use: ``ref_count > 0`` (held by one or more running requests);
- cached: ``ref_count == 0`` and it holds a full block's hash; it can be reused by a
  prefix hit, or evicted (least recently freed first) when free blocks run out;
- free: ``ref_count == 0`` and no hash.
Cached and free blocks both sit in ``free_queue``, ordered by when they were freed, so
allocation evicts the coldest cached block first. A block that no holder retains (a windowed
group's block outside every retained boundary's window, ``weir.kv_cache.retention``) loses its
hash when freed and goes to the front of the queue: it is reused before any cached block. Block 0 is the null block: never handed out,
it absorbs the KV writes of padding tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

NULL_BLOCK_ID = 0
ROOT_HASH = b"weir-prefix-root"


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Deterministic hash of a full block chained on its prefix (never Python's ``hash``)."""
    return hashlib.sha256(parent_hash + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached_block_of_hash: dict[bytes, int] = {}
        # block_id -> None, least recently freed first; excludes the null block
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # Whether a holder that freed the block, since it was last free, wants its entry kept.
        self.retained_by_a_holder = [False] * num_blocks
        self.num_hits = 0
        self.num_queries = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached ones."""
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached_block_of_hash.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on prefix-hit blocks, pulling cached ones out of the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int], retained: Sequence[bool] | None = None) -> None:
        """Drop one reference from each block; the tail of a request is freed first so that it is
        evicted first (its prefix is the part most likely to be shared). ``retained[i]`` False:
        this holder has no use for block i's cached entry; once its last holder frees it and none
        of them retained it, the block loses its hash and is reused first."""
        for index in reversed(range(len(block_ids))):
            block_id = block_ids[index]
            if retained is None or retained[index]:
                self.retained_by_a_holder[block_id] = True
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                if not self.retained_by_a_holder[block_id]:
                    self._evict(block_id)
                    self.free_queue.move_to_end(block_id, last=False)
                self.retained_by_a_holder[block_id] = False

    def cache_full_block(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached_block_of_hash:
            return  # the same content is cached in another block already; keep that one
        self.block_hash[block_id] = block_hash
        self.cached_block_of_hash[block_hash] = block_id

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached_block_of_hash[block_hash]
            self.block_hash[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free_queue):
            self._evict(block_id)

    def check_invariants(self, expected_in_use: int | None = None) -> None:
        """free + cached + in use == usable blocks, and the hash maps agree with each other."""
        in_use = sum(1 for b in range(1, self.num_blocks) if self.ref_counts[b] > 0)
        queued = len(self.free_queue)
        cached = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        free = queued - cached
        assert free + cached + in_use == self.num_usable_blocks, (free, cached, in_use)
        assert all(self.ref_counts[b] == 0 and not self.retained_by_a_holder[b] for b in self.free_queue)
        assert self.ref_counts[NULL_BLOCK_ID] == 0 and NULL_BLOCK_ID not in self.free_queue
        for block_hash, block_id in self.cached_block_of_hash.items():
            assert self.block_hash[block_id] == block_hash
        if expected_in_use is not None:
            assert in_use == expected_in_use, f"{in_use} blocks in use, expected {expected_in_use}"
