"""The platform-driver interface: what the engine needs to know about a kind of device.

A platform driver says whether its device exists on this machine, which collective backend and
kernels work there, which attention and MoE backends it prefers, and how much memory is free.
Drivers are plugins (``weir_platforms`` hook); among the available ones the highest-priority
driver is active, unless the user names one with ``--device``.

Importing this module, or any driver module, must not touch a device: a CUDA context created at
import time breaks forked workers. Availability is only probed when ``is_available`` is called.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch


class Platform(ABC):
    """A device family (cpu, cuda, rocm, xpu) and the engine settings that go with it.

    Subclasses set the class attributes below and implement the probes. Keep each probe a small
    method (``_torch_cuda_available`` and the like) so tests can replace it.
    """

    name: ClassVar[str]  # the name users pass to --device
    device_type: ClassVar[str]  # torch device type: "cpu", "cuda" or "xpu" (ROCm is "cuda")
    dist_backend: ClassVar[str]  # torch.distributed backend: "gloo", "nccl", "rccl", "xccl"
    supports_graphs: ClassVar[bool] = False  # can capture and replay device graphs
    supports_triton: ClassVar[bool] = False  # Triton kernels compile for this device
    pin_memory: ClassVar[bool] = False  # page-locked host memory exists for async copies
    preferred_attention_backends: ClassVar[tuple[str, ...]] = ("torch",)
    preferred_moe_backends: ClassVar[tuple[str, ...]] = ("torch",)

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this machine has the device and the installed torch can use it."""

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why ``is_available()`` is False, in words a user can act on ("" when available)."""
        return "" if cls.is_available() else f"platform {cls.name!r} is not available"

    def device(self, index: int = 0) -> torch.device:
        """The torch device for local rank ``index``."""
        return torch.device(self.device_type, index)

    def start_device_setup(self) -> Callable[[], None]:
        """Begin the set-up that needs no model config (driver, context), so that it overlaps the
        engine reading the config; returns a function that waits for it. Default: none to do."""
        return lambda: None

    @abstractmethod
    def memory_info(self, index: int = 0) -> tuple[int, int]:
        """(free, total) device memory in bytes."""

    @abstractmethod
    def synchronize(self, index: int = 0) -> None:
        """Wait for all work queued on the device."""

    def default_kv_cache_bytes(self, model_bytes: int) -> int:
        """KV-cache size when the user sets none and there is no profiling pass.

        Accelerators size the cache from a profiling forward and --gpu-memory-utilization, so
        only platforms without that pass (the CPU) implement this.
        """
        raise NotImplementedError(
            f"platform {self.name!r} sizes its KV cache by profiling; "
            "set kv_cache_memory_bytes or gpu_memory_utilization instead"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_type={self.device_type!r})"
