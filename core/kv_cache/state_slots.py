"""Fixed per-request state slots for linear-attention layers (conv + recurrent state).

A slot holds one request's state for every linear-attention layer at once; which tensors those
are is the runner's business (``weir.linear_attention``). Invariant (``check_invariants``): every
slot in ``0..num_slots-1`` is either free or held by exactly one request, never both. The
runner's extra padding slot (index ``num_slots``) is never handed out.
"""

from __future__ import annotations


class StateSlotPool:
    """Hands out slots ``0..num_slots-1``, each to one running request at a time."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a model with linear-attention layers needs at least 1 state slot, got {num_slots}")
        self.num_slots = num_slots
        # A stack: the most recently freed slot is reused first (its state is likely still cached).
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._held)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back; freeing a slot that is not held is a bookkeeping bug, so it raises."""
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)

    def check_invariants(self) -> None:
        """Assert that every slot is either free or held, never both, never lost (tests call it)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a state slot is free twice"
        assert not free & self._held, "a state slot is both free and held"
        assert free | self._held == set(range(self.num_slots)), "a state slot is lost"
