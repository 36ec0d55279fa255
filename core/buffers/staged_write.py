"""Device tensors updated by diffs staged on the host and applied in one op per step.

The host never reads the device copy back; it only appends writes. ``apply`` turns all staged
writes into one flat index/value pair, copies both to the device (pinned and non-blocking
where the platform has pinned memory), and scatters them. A Triton kernel can replace
``scatter_flat`` without changing callers.
"""

from __future__ import annotations

import numpy as np
import torch

from weir.kernels.dispatch import triton_module, use_triton


def host_to_device(array: np.ndarray, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """Copy a host array to the device without an implicit sync.

    A fresh tensor is copied each time (never a reused buffer the host might overwrite while
    the copy is still in flight); torch's pinned allocator keeps it alive until the copy ends.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    if pin_memory:
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=pin_memory)


def int64_arrays_to_device(arrays: list[np.ndarray], device: torch.device, pin_memory: bool) -> list[torch.Tensor]:
    """``host_to_device`` of several integer arrays as one int64 copy (one pinned buffer, one
    transfer: each pinning costs host time); device views of each, in its own shape."""
    packed = host_to_device(np.concatenate([np.asarray(array, dtype=np.int64).ravel() for array in arrays]),
                            device, pin_memory)
    views, offset = [], 0
    for array in arrays:
        views.append(packed[offset: offset + array.size].view(array.shape))
        offset += array.size
    return views


def scatter_flat(target: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> None:
    """``target.view(-1)[flat_index] = values``: the one op that applies staged writes.

    A Triton kernel on CUDA tensors (``weir.kernels.dispatch``), torch elsewhere. Indices must
    be distinct: which of two writes to one element wins is unspecified.
    """
    if use_triton(target):
        triton_module("triton_input_prep").scatter_flat_triton(target, flat_index, values)
    else:
        scatter_flat_torch(target, flat_index, values)


def scatter_flat_torch(target: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> None:
    target.view(-1).index_copy_(0, flat_index, values.to(target.dtype))


class StagedWriteTensor:
    """A ``[num_rows, num_cols]`` (or ``[num_rows]``) device tensor written through staged diffs."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 pin_memory: bool, fill_value: int | float = 0):
        self.device = device
        self.pin_memory = pin_memory
        self.gpu = torch.full(shape, fill_value, dtype=dtype, device=device)
        self.num_cols = shape[1] if len(shape) == 2 else 1
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self._indices: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    def stage(self, row: int, values, start: int = 0) -> None:
        """Write ``values`` at ``[row, start:start + len(values)]`` (a scalar for 1-D tensors)."""
        values = np.atleast_1d(np.asarray(values, dtype=self._np_dtype))
        if start + len(values) > self.num_cols:
            raise ValueError(f"write of {len(values)} values at column {start} overflows {self.num_cols} columns")
        base = row * self.num_cols + start
        self._indices.append(np.arange(base, base + len(values), dtype=np.int64))
        self._values.append(values)

    def apply(self) -> None:
        if not self._indices:
            return
        flat_index = host_to_device(np.concatenate(self._indices), self.device, self.pin_memory)
        values = host_to_device(np.concatenate(self._values), self.device, self.pin_memory)
        scatter_flat(self.gpu, flat_index, values)
        self._indices.clear()
        self._values.clear()
