"""The slot-indexed state of a hybrid model's linear-attention layers, as the runner holds it.

Sizing rule: one slot per schedulable request (``max_num_seqs``), unless that would take more
than half of the memory left after the weights and the KV cache's least (one request of
``max_model_len``, or ``kv_cache_memory_bytes`` on an accelerator; see
``ModelRunner._state_room_bytes``); then as many as fit in that half (the scheduler's slot pool
then caps how many requests run at once). The KV cache gets what is left after the state; with
prefix caching, the state checkpoints come out of the KV cache's budget
(``weir.runner.checkpoint_sizing``).

State copies (prefix caching): an admitted request whose hit resumes from a checkpoint gets the
checkpoint copied into its slot instead of zeros, before the step's forward; a request whose
chunk ends at a retained boundary has its slot copied into a checkpoint after the forward. Both
are device copies on the step's stream, with indices sent through pinned memory: no host sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from weir.buffers.staged_write import host_to_device
from weir.kv_cache.state_checkpoints import StateCopies
from weir.layer_cache import StateCacheSpec
from weir.linear_attention import LayerState, LinearAttentionBackend, copy_state_slots

logger = logging.getLogger(__name__)
GiB = 2**30


def state_bytes_per_slot(layers: list[StateCacheSpec],
                         backend_of: Callable[[StateCacheSpec], LinearAttentionBackend]) -> int:
    """Bytes one request's state takes across the linear-attention ``layers``."""
    return sum(backend_of(layer).state_bytes_per_slot(layer) for layer in layers)


class LinearAttentionState:
    """``layer_states[layer_idx]`` for every linear-attention layer (None elsewhere)."""

    def __init__(self, layers: list[StateCacheSpec], backend_of: Callable[[StateCacheSpec], LinearAttentionBackend],
                 num_layers: int, max_num_seqs: int, room_bytes: int,
                 remedy: str = "raise gpu_memory_utilization or use a device with more memory"):
        """``backend_of(layer)``: the backend serving the layer's kind, which allocates its state."""
        self.bytes_per_slot = state_bytes_per_slot(layers, backend_of)
        self.num_slots = min(max_num_seqs, (room_bytes // 2) // self.bytes_per_slot - 1)  # - 1: the padding slot
        if self.num_slots < 1:
            raise ValueError(
                f"no room for linear-attention state: one request needs {self.bytes_per_slot / 2**20:.1f} MiB "
                f"across {len(layers)} layers, and half of the {max(room_bytes, 0) / GiB:.2f} GiB left for the state, "
                f"the activations and the KV cache is less than two of those (one is the padding slot); {remedy}")
        if self.num_slots < max_num_seqs:
            logger.warning("linear-attention state for %d requests would not fit: %d state slots, so at most %d "
                           "requests run at once", max_num_seqs, self.num_slots, self.num_slots)
        self.layers = layers
        self.backend_of = backend_of
        self.layer_states: list[LayerState | None] = [None] * num_layers
        for layer in layers:
            self.layer_states[layer.layer_idx] = backend_of(layer).allocate_state(self.num_slots, layer)
        self.num_checkpoints = 0
        self.checkpoint_states: list[LayerState | None] = [None] * num_layers
        logger.info("linear-attention state: %d slots x %.1f MiB = %.2f GiB", self.num_slots,
                    self.bytes_per_slot / 2**20, self.total_bytes / GiB)

    @property
    def total_bytes(self) -> int:
        return (self.num_slots + 1) * self.bytes_per_slot

    def allocate_checkpoints(self, num_checkpoints: int) -> None:
        """The prefix cache's checkpoint slots, in each layer's own state layout."""
        self.num_checkpoints = num_checkpoints
        for layer in self.layers:
            # allocate_state adds a padding slot, which checkpoints have no use for.
            self.checkpoint_states[layer.layer_idx] = self.backend_of(layer).allocate_state(num_checkpoints - 1, layer)
        logger.info("linear-attention state checkpoints (prefix caching): %d slots x %.1f MiB = %.2f GiB",
                    num_checkpoints, self.bytes_per_slot / 2**20, self.checkpoint_bytes / GiB)

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoints * self.bytes_per_slot

    def zero_slots(self, slots: list[int], device: torch.device, pin_memory: bool) -> None:
        """Reset the slots of newly admitted requests (one launch pair per layer, on the step's stream)."""
        if not slots:
            return
        slot_ids = host_to_device(np.asarray(slots, dtype=np.int64), device, pin_memory)
        for layer in self.layers:
            self.layer_states[layer.layer_idx].zero_slots(slot_ids)

    def admit(self, slots: list[int], copies: StateCopies | None, device: torch.device, pin_memory: bool) -> None:
        """The initial state of newly admitted requests' slots: the checkpoint their prefix hit
        resumes from, zeros for the others."""
        loads = copies.loads if copies is not None else []
        loaded = {state_slot for _, state_slot in loads}
        self.zero_slots([slot for slot in slots if slot not in loaded], device, pin_memory)
        self._copy([checkpoint for checkpoint, _ in loads], self.checkpoint_states,
                   [state_slot for _, state_slot in loads], self.layer_states, device, pin_memory)

    def save_checkpoints(self, copies: StateCopies | None, device: torch.device, pin_memory: bool) -> None:
        """After the step's forward: the states that end at retained boundaries, into checkpoints."""
        if copies is not None and copies.saves:
            saves = copies.saves
            self._copy([state_slot for state_slot, _ in saves], self.layer_states,
                       [checkpoint for _, checkpoint in saves], self.checkpoint_states, device, pin_memory)

    def _copy(self, slots: list[int], source: list, target_slots: list[int], target: list,
              device: torch.device, pin_memory: bool) -> None:
        if not slots:
            return
        indices = host_to_device(np.asarray([slots, target_slots], dtype=np.int64), device, pin_memory)  # [2, n]
        for layer in self.layers:
            copy_state_slots(source[layer.layer_idx], indices[0], target[layer.layer_idx], indices[1])
