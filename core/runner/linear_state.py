"""The slot-indexed state of a hybrid model's linear-attention layers, as the runner holds it.

Sizing rule: one slot per schedulable request (``max_num_seqs``), unless that would take more
than half of the memory left after the weights; then as many as fit in that half (the
scheduler's slot pool then caps how many requests run at once). The KV cache gets what is
left after the state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from weir.layer_cache import StateCacheSpec
from weir.linear_attention import LayerState, LinearAttentionBackend
from weir.buffers.staged_write import host_to_device

logger = logging.getLogger(__name__)
GiB = 2**30


class LinearAttentionState:
    """``layer_states[layer_idx]`` for every linear-attention layer (None elsewhere)."""

    def __init__(self, layers: list[StateCacheSpec], backend_of: Callable[[StateCacheSpec], LinearAttentionBackend],
                 num_layers: int, max_num_seqs: int, room_bytes: int,
                 remedy: str = "raise gpu_memory_utilization or use a device with more memory"):
        """``backend_of(layer)``: the backend serving the layer's kind, which allocates its state."""
        self.bytes_per_slot = sum(backend_of(layer).state_bytes_per_slot(layer) for layer in layers)
        self.num_slots = min(max_num_seqs, (room_bytes // 2) // self.bytes_per_slot - 1)  # - 1: the padding slot
        if self.num_slots < 1:
            raise ValueError(
                f"no room for linear-attention state: one request needs {self.bytes_per_slot / 2**20:.1f} MiB "
                f"across {len(layers)} layers, and half of the {room_bytes / GiB:.2f} GiB left after the weights "
                f"is less than two of those (one is the padding slot); {remedy}")
        if self.num_slots < max_num_seqs:
            logger.warning("linear-attention state for %d requests would not fit: %d state slots, so at most %d "
                           "requests run at once", max_num_seqs, self.num_slots, self.num_slots)
        self.layers = layers
        self.layer_states: list[LayerState | None] = [None] * num_layers
        for layer in layers:
            self.layer_states[layer.layer_idx] = backend_of(layer).allocate_state(self.num_slots, layer)
        logger.info("linear-attention state: %d slots x %.1f MiB = %.2f GiB", self.num_slots,
                    self.bytes_per_slot / 2**20, self.total_bytes / GiB)

    @property
    def total_bytes(self) -> int:
        return (self.num_slots + 1) * self.bytes_per_slot

    def zero_slots(self, slots: list[int], device: torch.device, pin_memory: bool) -> None:
        """Reset the slots of newly admitted requests (one launch pair per layer, on the step's stream)."""
        if not slots:
            return
        slot_ids = host_to_device(np.asarray(slots, dtype=np.int64), device, pin_memory)
        for layer in self.layers:
            self.layer_states[layer.layer_idx].zero_slots(slot_ids)
