"""Linear-attention state checkpoints: the host bookkeeping of the prefix cache's state entries.

A hybrid model's linear-attention layers cannot resume from cached KV blocks: their state after
a prefix is all they keep. A *checkpoint* is every state layer's state (conv and recurrent) of
one request at a block boundary, copied on the device into a checkpoint slot (``weir.runner.
linear_state``), and keyed by the chained hash of the block that ends at that boundary (the key
of the full-attention block there). A prefix hit resumes the linear layers from the checkpoint
at the hit boundary.

Every checkpoint slot is in exactly one of three states (``check_invariants``):
- pending: reserved by this step's schedule for a save that runs after this step's forward; it
  becomes hittable only when the step's copies are taken (``commit``), so no request of the same
  step reads a state before it is written;
- cached: holds a committed checkpoint's hash; a hit copies it and refreshes it, and it is evicted
  (least recently used first) when a save needs a slot;
- free: no hash.
Cached and free slots both sit in ``queue``, least recently used first, as blocks do in
``weir.kv_cache.block_pool``. A checkpoint is never held by a request: a hit copies it into the
request's own state slot before the step's forward, so nothing pins it past the step.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class StateCopies:
    """One step's device copies between running state slots and checkpoint slots."""

    # (checkpoint slot, state slot): before the forward, into newly admitted requests' slots.
    loads: list[tuple[int, int]] = field(default_factory=list)
    # (state slot, checkpoint slot): after the forward, the state at the end of the request's chunk.
    saves: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


class CheckpointPool:
    """Hands out checkpoint slots ``0..num_slots-1`` and maps chained block hashes onto them."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a checkpoint pool needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_hash: list[bytes | None] = [None] * num_slots
        self.slot_of_hash: dict[bytes, int] = {}  # committed checkpoints only
        self.pending: dict[bytes, int] = {}  # reserved by this step, written after its forward
        self.queue: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(num_slots))
        self.num_saved = 0  # checkpoints committed since start
        self.num_evicted = 0  # of those, dropped to make room

    @property
    def num_cached(self) -> int:
        return len(self.slot_of_hash)

    def lookup(self, block_hash: bytes) -> int | None:
        """The committed checkpoint of this boundary, or None."""
        return self.slot_of_hash.get(block_hash)

    def contains(self, block_hash: bytes) -> bool:
        """Whether this boundary's state is kept already or will be after this step."""
        return block_hash in self.slot_of_hash or block_hash in self.pending

    def touch(self, slot: int) -> None:
        """A hit read this checkpoint: it becomes the most recently used."""
        self.queue.move_to_end(slot)

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for this boundary's state, evicting the least recently used checkpoint; None
        when every slot is pending (more saves in one step than slots)."""
        if block_hash in self.pending or block_hash in self.slot_of_hash:
            raise ValueError("this boundary's state is kept already: check contains() first")
        if not self.queue:
            return None
        slot, _ = self.queue.popitem(last=False)
        old_hash = self.slot_hash[slot]
        if old_hash is not None:
            del self.slot_of_hash[old_hash]
            self.num_evicted += 1
        self.slot_hash[slot] = block_hash
        self.pending[block_hash] = slot
        return slot

    def commit(self) -> None:
        """The step's saves are issued (they run after its forward, before any later step's
        loads): its pending checkpoints become hittable, most recently used."""
        for block_hash, slot in self.pending.items():
            self.slot_of_hash[block_hash] = slot
            self.queue[slot] = None
        self.num_saved += len(self.pending)
        self.pending.clear()

    def reset(self) -> None:
        """Forget every checkpoint (after a failed step, whose saves may never have run)."""
        for slot in range(self.num_slots):
            self.slot_hash[slot] = None
            if slot not in self.queue:
                self.queue[slot] = None
        self.slot_of_hash.clear()
        self.pending.clear()

    def check_invariants(self, between_steps: bool = True) -> None:
        """Free + cached + pending == slots, and the hash maps agree; ``between_steps``: the last
        step's copies were taken, so nothing is pending."""
        queued = set(self.queue)
        pending_slots = set(self.pending.values())
        assert len(pending_slots) == len(self.pending), "a checkpoint slot is pending twice"
        assert not queued & pending_slots, "a checkpoint slot is both pending and queued"
        assert queued | pending_slots == set(range(self.num_slots)), "a checkpoint slot is lost"
        for block_hash, slot in self.slot_of_hash.items():
            assert self.slot_hash[slot] == block_hash and slot in queued, f"checkpoint slot {slot} is inconsistent"
        for block_hash, slot in self.pending.items():
            assert self.slot_hash[slot] == block_hash, f"pending checkpoint slot {slot} is inconsistent"
        cached = sum(1 for slot in queued if self.slot_hash[slot] is not None)
        assert cached == len(self.slot_of_hash), f"{cached} queued slots have a hash, {len(self.slot_of_hash)} cached"
        if between_steps:
            assert not self.pending, f"{len(self.pending)} checkpoints still pending between steps"


class StateCheckpoints:
    """The KV manager's checkpoint side: the pool, and the copies the current step plans.

    ``hashes`` below are a request's chained block hashes (``Request.update_block_hashes``); a
    boundary of ``b`` tokens is keyed by ``hashes[b // block_size - 1]``.
    """

    def __init__(self, num_slots: int, block_size: int):
        self.pool = CheckpointPool(num_slots)
        self.block_size = block_size
        self.step = StateCopies()

    def resumable(self, hashes: list[bytes], num_blocks: int) -> bool:
        """Whether a committed checkpoint ends exactly at ``num_blocks`` blocks."""
        return self.pool.lookup(hashes[num_blocks - 1]) is not None

    def kept(self, hashes: list[bytes], boundary: int) -> bool:
        return self.pool.contains(hashes[boundary // self.block_size - 1])

    def chunk_end(self, hashes: list[bytes], retained: tuple[int, ...], start: int, num_new: int) -> int:
        """``num_new``, cut so that the chunk ends at the first retained boundary after ``start``
        whose state is not kept yet."""
        for index in range(bisect_right(retained, start), len(retained)):  # decode steps: nothing after start
            boundary = retained[index]
            if boundary >= start + num_new:
                break
            if not self.kept(hashes, boundary):
                return boundary - start
        return num_new

    def plan(self, hashes: list[bytes], state_slot: int, retained: tuple[int, ...], num_hit_blocks: int,
             num_tokens_after_step: int) -> None:
        """One scheduled request's copies: the hit's checkpoint into its slot before the forward;
        its slot into a new checkpoint after it, when the chunk ends at a retained boundary whose
        state is not kept yet."""
        if num_hit_blocks:
            slot = self.pool.lookup(hashes[num_hit_blocks - 1])
            if slot is None:
                raise RuntimeError(f"a prefix hit of {num_hit_blocks} blocks has no state checkpoint there "
                                   f"(get_computed_blocks must come just before the allocation)")
            self.pool.touch(slot)
            self.step.loads.append((slot, state_slot))
        boundary = num_tokens_after_step
        if (boundary % self.block_size == 0 and retained and boundary <= retained[-1] and boundary in retained
                and not self.kept(hashes, boundary)):
            slot = self.pool.reserve(hashes[boundary // self.block_size - 1])
            if slot is not None:  # None: this step's saves took every slot; this one is skipped
                self.step.saves.append((state_slot, slot))

    def take(self) -> StateCopies | None:
        """The step's copies (None: none); from now on its saves count as issued."""
        copies, self.step = self.step, StateCopies()
        self.pool.commit()
        return copies if copies else None

    def reset(self) -> None:
        self.pool.reset()
        self.step = StateCopies()

    def check_invariants(self, held_state_slots: set[int], idle: bool) -> None:
        """The pool's invariants; the pending slots are exactly this step's save targets; every
        copy names a state slot some request holds."""
        self.pool.check_invariants(between_steps=idle)
        saved_into = sorted(slot for _, slot in self.step.saves)
        assert saved_into == sorted(self.pool.pending.values()), (
            f"pending checkpoint slots {sorted(self.pool.pending.values())}, this step saves into {saved_into}")
        for state_slot in [s for _, s in self.step.loads] + [s for s, _ in self.step.saves]:
            assert state_slot in held_state_slots, f"a state copy names state slot {state_slot}, which no request holds"
