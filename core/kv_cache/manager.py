"""Maps requests onto the blocks of every paged cache group (prefix-cache lookups, allocation,
window freeing, freeing) and, for hybrid models, onto linear-attention state slots and the
prefix cache's state checkpoints.

Each paged cache group (``weir.layer_cache``) has its own ``BlockPool`` and gives each request its
own list of block ids, indexed by ``position // block_size``. A windowed group frees a block as
soon as it lies wholly before the window of the request's next query, and puts the null block in
its place, so a request decoding far past the window holds at most ``ceil(W / block_size) + 1``
blocks there. Every group hashes its full blocks with the same chained hashes, so a prefix hit
of L tokens needs, in each group, the blocks that group's next query reads: all of them for a
full group, the window's last blocks for a windowed one; and, for a hybrid model, a state
checkpoint at exactly L (``weir.kv_cache.state_checkpoints``), which is copied into the request's
state slot before its first step. Which boundaries keep a checkpoint, and which window blocks stay
cached, is the retention rule (``weir.kv_cache.retention``): to save the state at a boundary inside
a prompt, a chunk ends there (``end_chunk_at_checkpoint``) and the runner copies the request's slot
into a checkpoint slot after that step's forward (``take_state_copies`` says which).

Invariants (``check_invariants``): in every group, free + cached + in use == usable blocks, and
each block's reference count is the number of requests holding it; every state slot is free or
held by one request; every checkpoint slot is free, cached or reserved by this step's saves, and
the step's copies name only held state slots. Nothing is held once every request has ended.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weir.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from weir.kv_cache.retention import retained_boundaries
from weir.kv_cache.state_checkpoints import StateCheckpoints, StateCopies
from weir.kv_cache.state_slots import StateSlotPool

if TYPE_CHECKING:  # the request module imports the block pool's hashing
    from weir.request import Request


@dataclass(frozen=True)
class GroupConfig:
    """One paged cache group as the KV manager sees it."""

    num_blocks: int  # including the null block
    sliding_window: int | None = None  # None: every token's entry is kept


@dataclass
class _RequestBlocks:
    """A request's block ids per group (null where a window freed them) and how many of its
    leading blocks every group has registered in the prefix cache."""

    block_ids: list[list[int]]
    num_cached_blocks: int = 0
    # Per windowed group, the first index that may still hold a live block.
    first_live: list[int] = field(default_factory=list)
    # Token counts whose prefix stays reusable (weir.kv_cache.retention), fixed at admission.
    retained: tuple[int, ...] = ()
    # Tokens every group's blocks have room for (the decode fast path's test).
    num_slots: int = 0


class KVCacheManager:
    def __init__(self, block_size: int, groups: list[GroupConfig], enable_prefix_caching: bool,
                 num_state_slots: int = 0, num_checkpoint_slots: int = 0, retention_interval: int | None = None):
        """``num_state_slots`` > 0: the model has linear-attention layers, and every running
        request also holds one state slot (taken at admission, given back when it stops running);
        with prefix caching such a model needs ``num_checkpoint_slots`` >= 1. ``retention_interval``:
        the retention rule (``weir.kv_cache.retention``; None: every boundary)."""
        if not groups:
            raise ValueError("a KV cache needs at least one paged cache group")
        if retention_interval is not None and (retention_interval < 0 or retention_interval % block_size):
            raise ValueError(f"the prefix-cache retention interval must be 0 or a positive multiple of the block "
                             f"size {block_size}, got {retention_interval}")
        self.block_size = block_size
        self.groups = list(groups)
        self.pools = [BlockPool(group.num_blocks, enable_prefix_caching) for group in groups]
        # What a step that needs no new block appends: shared, so immutable.
        self._nothing_appended: tuple[tuple[int, ...], ...] = tuple(() for _ in groups)
        # Groups that free blocks behind a window (none for full-attention-only models, whose
        # decode step then skips the window walk).
        self._windowed = [(g, group, pool) for g, (group, pool) in enumerate(zip(self.groups, self.pools))
                          if group.sliding_window is not None]
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots > 0 else None
        self.checkpoints: StateCheckpoints | None = None
        if self.state_slots is not None and enable_prefix_caching:
            if num_checkpoint_slots < 1:
                raise ValueError("prefix caching for a model with linear-attention layers needs at least one state "
                                 "checkpoint slot: a hit cannot resume those layers from KV blocks")
            self.checkpoints = StateCheckpoints(num_checkpoint_slots, block_size)
        self.retention_interval = retention_interval
        # Whether anything depends on the retention rule: state checkpoints or window blocks.
        self._uses_retention = enable_prefix_caching and (
            self.checkpoints is not None or any(group.sliding_window is not None for group in groups))
        # Retained boundaries of requests looked up but not admitted yet (their junction is known).
        self._admission_boundaries: dict[str, tuple[int, ...]] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up, once per admission
        self.num_prefix_hits = 0  # of those, tokens the prefix cache served

    # ---- what the scheduler, the metrics and the logs read -------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Tokens of context the cache holds for the running requests: what the full-attention
        groups hold (windowed groups keep only each request's window, so they bound how many
        requests run, not how long they are), or, for a model windowed everywhere, the tokens its
        groups hold at once."""
        full = [pool for group, pool in zip(self.groups, self.pools) if group.sliding_window is None]
        return min(pool.num_usable_blocks for pool in full or self.pools) * self.block_size

    def usage(self) -> float:
        """Fraction of the fullest group's blocks held by running requests (0 to 1)."""
        return max(pool.usage() for pool in self.pools)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request: Request) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (copies)."""
        held = self._requests.get(request.request_id)
        if held is None:
            return tuple([] for _ in self.groups)
        return tuple(list(ids) for ids in held.block_ids)

    # ---- prefix cache ---------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[int], ...], int]:
        """The longest prefix every group can resume from: per group the blocks to take over
        (null where a window needs none), and the number of tokens they cover.

        At least one token is always left to compute, so the step produces logits to sample from.
        """
        no_hit = tuple([] for _ in self.groups), 0
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return no_hit
        hashes = request.update_block_hashes(self.block_size)
        num_blocks = (request.num_tokens - 1) // self.block_size
        cached = [[pool.lookup(block_hash) for block_hash in hashes[:num_blocks]] for pool in self.pools]
        self._plan_retention(request, cached)
        for group, group_cached in zip(self.groups, cached):
            if group.sliding_window is None:  # a full group hits on an unbroken prefix only
                num_blocks = next((i for i, block_id in enumerate(group_cached) if block_id is None), num_blocks)
        while num_blocks > 0 and not (self._state_resumable(hashes, num_blocks) and all(
                self._window_cached(group, group_cached, num_blocks) for group, group_cached in zip(self.groups, cached))):
            num_blocks -= 1
        if num_blocks == 0:
            return no_hit
        hits = []
        for group, group_cached in zip(self.groups, cached):
            first = self._first_needed_block(group, num_blocks * self.block_size)
            hits.append([NULL_BLOCK_ID] * first + group_cached[first:num_blocks])
        if all(block_id == NULL_BLOCK_ID for group_hits in hits for block_id in group_hits):
            return no_hit  # windows of one token need no cached block: nothing was found
        return tuple(hits), num_blocks * self.block_size

    def _first_needed_block(self, group: GroupConfig, next_position: int) -> int:
        """First block the query at ``next_position`` reads in ``group``."""
        if group.sliding_window is None:
            return 0
        return max(0, next_position - group.sliding_window + 1) // self.block_size

    def _window_cached(self, group: GroupConfig, group_cached: list[int | None], num_blocks: int) -> bool:
        first = self._first_needed_block(group, num_blocks * self.block_size)
        return all(block_id is not None for block_id in group_cached[first:num_blocks])

    def _state_resumable(self, hashes: list[bytes], num_blocks: int) -> bool:
        """Whether the linear-attention layers (if any) can resume after ``num_blocks`` blocks."""
        return self.checkpoints is None or self.checkpoints.resumable(hashes, num_blocks)

    def _plan_retention(self, request: Request, cached: list[list[int | None]]) -> None:
        """Fix the request's retained boundaries while its junction is known: the end of the
        longest prefix whose last block some group still caches (the hashes chain, so that whole
        prefix was seen before)."""
        if not self._uses_retention:
            return
        junction = 0
        if self.retention_interval == 0:
            junction = next((num_blocks for num_blocks in range(len(cached[0]), 0, -1)
                             if any(group_cached[num_blocks - 1] is not None for group_cached in cached)), 0)
        self._admission_boundaries[request.request_id] = retained_boundaries(
            request.num_tokens, self.block_size, self.retention_interval, junction * self.block_size)

    def _retained(self, request: Request) -> tuple[int, ...]:
        held = self._requests.get(request.request_id)
        if held is not None:
            return held.retained
        if not self._uses_retention:
            return ()
        boundaries = self._admission_boundaries.get(request.request_id)
        if boundaries is None:  # never looked up (an admission without get_computed_blocks)
            boundaries = retained_boundaries(request.num_tokens, self.block_size, self.retention_interval)
        return boundaries

    def end_chunk_at_checkpoint(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, cut so that the chunk ends at the next retained
        boundary whose state is not kept yet: the state is saved after the step that ends there."""
        if self.checkpoints is None:
            return num_new
        return self.checkpoints.chunk_end(request.update_block_hashes(self.block_size), self._retained(request),
                                          start, num_new)

    def take_state_copies(self) -> StateCopies | None:
        """This step's checkpoint loads and saves for the runner (None: none); once taken, the
        saves count as issued, so later steps may hit them."""
        return None if self.checkpoints is None else self.checkpoints.take()

    def _window_retained(self, group: GroupConfig, held: _RequestBlocks, index: int) -> bool:
        """Whether block ``index`` of a windowed group is in the window of a retained boundary."""
        if self.retention_interval is None:
            return True
        # The first boundary after the block: the window of any later one starts no earlier.
        after = bisect_left(held.retained, (index + 1) * self.block_size)
        return after < len(held.retained) and self._first_needed_block(group, held.retained[after]) <= index

    def count_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Prefix-cache statistics, once per admission: a request waiting for blocks is looked
        up again every step, and counting each lookup inflated queries and hits."""
        if self.enable_prefix_caching:
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.reset()

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: tuple[list[int], ...] | None = None) -> tuple[Sequence[int], ...] | None:
        """Give the request blocks for ``num_new_tokens`` more tokens (after any prefix-hit
        ``computed_blocks``, as ``get_computed_blocks`` returned them). Returns per group the block
        ids appended to its table (read-only), or None when some group cannot hold them: nothing is
        allocated then (blocks that fell out of a window may have been freed, which is due anyway).
        """
        held = self._requests.get(request.request_id)
        if held is None:
            held = _RequestBlocks([[] for _ in self.groups], first_live=[0] * len(self.groups),
                                  retained=self._retained(request))
        needs_state_slot = self.state_slots is not None and request.state_slot is None
        if needs_state_slot and self.state_slots.num_free == 0:
            return None
        has_hits = computed_blocks is not None and any(computed_blocks)
        num_computed = request.num_computed_tokens
        if has_hits:
            num_computed += len(computed_blocks[0]) * self.block_size
        num_tokens_after_step = num_computed + num_new_tokens
        # Drafts still being verified may all be rejected: the device's query may start that much earlier.
        if self._windowed:
            self._free_out_of_window(held, max(0, num_computed - request.num_unverified_drafts))
        if not has_hits and not needs_state_slot and num_tokens_after_step <= held.num_slots:
            # Decode's common case: every last block has room; at most a newly full block to cache.
            block_size = self.block_size
            if self.enable_prefix_caching and num_tokens_after_step >= (held.num_cached_blocks + 1) * block_size:
                self._cache_full_blocks(request, held, num_tokens_after_step)
            if self.checkpoints is not None and num_tokens_after_step % block_size == 0:  # a prefill chunk's end
                self.checkpoints.plan(request.update_block_hashes(block_size), request.state_slot,
                                      held.retained, 0, num_tokens_after_step)
            return self._nothing_appended
        num_blocks_needed = self.blocks_for(num_tokens_after_step)
        hits = computed_blocks if has_hits else tuple([] for _ in self.groups)
        num_new_blocks = []
        for pool, ids, group_hits in zip(self.pools, held.block_ids, hits):
            num_new = max(0, num_blocks_needed - len(ids) - len(group_hits))
            # Touching a cached hit block takes it out of the free queue too.
            num_hits_in_free_queue = sum(1 for b in group_hits if b != NULL_BLOCK_ID and pool.ref_counts[b] == 0)
            if num_new + num_hits_in_free_queue > pool.num_free_blocks:
                return None
            num_new_blocks.append(num_new)
        appended = []
        for pool, ids, group_hits, num_new in zip(self.pools, held.block_ids, hits, num_new_blocks):
            pool.touch([b for b in group_hits if b != NULL_BLOCK_ID])
            new_blocks = list(group_hits) + pool.allocate(num_new)
            ids.extend(new_blocks)
            appended.append(new_blocks)
        held.num_slots = min(map(len, held.block_ids)) * self.block_size
        self._requests[request.request_id] = held
        self._admission_boundaries.pop(request.request_id, None)
        if needs_state_slot:
            request.state_slot = self.state_slots.allocate()
        self._cache_full_blocks(request, held, num_tokens_after_step)
        if self.checkpoints is not None:
            self.checkpoints.plan(request.update_block_hashes(self.block_size), request.state_slot, held.retained,
                                  len(hits[0]) if has_hits else 0, num_tokens_after_step)
        return tuple(appended)

    def free_out_of_window(self, request: Request) -> None:
        """Free the windowed groups' blocks that no query from ``request.num_surely_computed_tokens``
        on reads. ``allocate_slots`` does it for every request it serves; the scheduler calls this for
        running requests it serves nothing this step (waiting for their last token under async
        scheduling), whose last chunk would otherwise hold its blocks a step longer."""
        held = self._requests.get(request.request_id)
        if held is not None and self._windowed:
            self._free_out_of_window(held, request.num_surely_computed_tokens)

    def _free_out_of_window(self, held: _RequestBlocks, next_position: int) -> None:
        """Free, in each windowed group, the blocks before the window of the query at
        ``next_position`` (this step's first): no later query of the request reads them."""
        for g, group, pool in self._windowed:
            first_needed = self._first_needed_block(group, next_position)
            ids = held.block_ids[g]
            for index in range(held.first_live[g], min(first_needed, len(ids))):
                if ids[index] != NULL_BLOCK_ID:
                    pool.free([ids[index]], [self._window_retained(group, held, index)])
                    ids[index] = NULL_BLOCK_ID
            held.first_live[g] = max(held.first_live[g], first_needed)

    def _cache_full_blocks(self, request: Request, held: _RequestBlocks, num_tokens_after_step: int) -> None:
        # Only blocks whose every token is known and computed by the end of this step; KV for
        # a block cached now is written by this step's forward before any later step reads it.
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        if num_full <= held.num_cached_blocks:
            return
        hashes = request.update_block_hashes(self.block_size)
        for pool, ids in zip(self.pools, held.block_ids):
            for index in range(held.num_cached_blocks, num_full):
                if ids[index] != NULL_BLOCK_ID:
                    pool.cache_full_block(ids[index], hashes[index])
        held.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        self._admission_boundaries.pop(request.request_id, None)
        held = self._requests.pop(request.request_id, None)
        if held is not None:
            for group, pool, ids in zip(self.groups, self.pools, held.block_ids):
                live = [index for index, block_id in enumerate(ids) if block_id != NULL_BLOCK_ID]
                retained = (None if group.sliding_window is None
                            else [self._window_retained(group, held, index) for index in live])
                pool.free([ids[index] for index in live], retained)
        if request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None

    # ---- invariants -----------------------------------------------------------------------

    def check_idle(self) -> None:
        """Nothing may be held once no request runs: every usable block back in its pool's free
        queue (free or cached), every state slot free. Constant time per group, so the engine
        checks it whenever it goes idle; ``check_invariants`` is the thorough check."""
        assert not self._requests, f"requests still hold blocks: {sorted(self._requests)[:8]}"
        for g, pool in enumerate(self.pools):
            assert pool.num_free_blocks == pool.num_usable_blocks, (
                f"group {g}: {pool.num_usable_blocks - pool.num_free_blocks} blocks held with no request running")
        if self.state_slots is not None:
            assert self.state_slots.num_free == self.state_slots.num_slots, "a state slot is held with no request"

    def check_invariants(self, idle: bool = False) -> None:
        """Assert the allocators' invariants (module docstring); ``idle``: no request runs, so
        nothing may be held. Costs one pass over every block: tests call it after every step,
        the engine whenever it goes idle."""
        for g, pool in enumerate(self.pools):
            holders = Counter(b for held in self._requests.values() for b in held.block_ids[g] if b != NULL_BLOCK_ID)
            pool.check_invariants(expected_in_use=len(holders))
            for block_id, count in holders.items():
                assert pool.ref_counts[block_id] == count, (
                    f"group {g}: block {block_id} has {pool.ref_counts[block_id]} references, {count} holders")
        if self.state_slots is not None:
            self.state_slots.check_invariants()
        if self.checkpoints is not None:
            self.checkpoints.check_invariants(self.state_slots.held, idle)
        if idle:
            assert not self._requests, f"requests still hold blocks: {sorted(self._requests)}"
            assert self.state_slots is None or self.state_slots.num_free == self.state_slots.num_slots
            assert not self._admission_boundaries, f"lookups of ended requests kept: {sorted(self._admission_boundaries)}"
