"""Maps requests onto KV blocks (prefix-cache lookups, slot allocation, freeing) and, for
hybrid models, onto linear-attention state slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weir.kv_cache.block_pool import BlockPool
from weir.kv_cache.state_slots import StateSlotPool

if TYPE_CHECKING:  # the request module imports the block pool's hashing
    from weir.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_state_slots: int = 0):
        """``num_state_slots`` > 0: the model has linear-attention layers, and every running
        request also holds one state slot (taken at admission, given back when it stops running)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots > 0 else None

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    def usage(self) -> float:
        """Fraction of the KV cache's blocks held by running requests (0 to 1)."""
        return self.pool.usage()

    @property
    def num_prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache, once per admission."""
        return self.pool.num_queries

    @property
    def num_prefix_hits(self) -> int:
        """Of those, tokens the prefix cache served."""
        return self.pool.num_hits

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of the request.

        At least one token is always left to compute, so the step produces logits to sample from.
        """
        if not self.pool.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        hashes = request.update_block_hashes(self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit_blocks.append(block_id)
        return hit_blocks, len(hit_blocks) * self.block_size

    def count_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Prefix-cache statistics, once per admission: a request waiting for blocks is looked
        up again every step, and counting each lookup inflated queries and hits."""
        if self.pool.enable_prefix_caching:
            self.pool.num_queries += request.num_tokens
            self.pool.num_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Give the request blocks for ``num_new_tokens`` more tokens (after any prefix-hit
        ``computed_blocks``). Returns the block ids appended to its table, or None when the
        pool cannot hold them (nothing changes then)."""
        num_tokens_after_step = request.num_computed_tokens + num_new_tokens
        needs_state_slot = self.state_slots is not None and request.state_slot is None
        if needs_state_slot and self.state_slots.num_free == 0:
            return None
        has_room = len(request.block_ids) * self.block_size >= num_tokens_after_step
        if not computed_blocks and not needs_state_slot and has_room:
            # Decode's common case: the last block has room; at most a newly full block to cache.
            self._cache_full_blocks(request, num_tokens_after_step)
            return []
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_blocks_needed = self.blocks_for(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_blocks_needed - len(request.block_ids) - len(computed_blocks))
        # Touching a cached hit block takes it out of the free queue too.
        num_hits_in_free_queue = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + num_hits_in_free_queue > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + self.pool.allocate(num_new_blocks)
        request.block_ids.extend(new_blocks)
        if needs_state_slot:
            request.state_slot = self.state_slots.allocate()
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        # Only blocks whose every token is known and computed by the end of this step; KV for
        # a block cached now is written by this step's forward before any later step reads it.
        if not self.pool.enable_prefix_caching:
            return
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        hashes = request.update_block_hashes(self.block_size)
        for index in range(request.num_cached_blocks, num_full):
            self.pool.cache_full_block(request.block_ids[index], hashes[index])
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0
        if request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None
