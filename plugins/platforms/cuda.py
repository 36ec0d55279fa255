"""The NVIDIA CUDA platform: NCCL collectives, CUDA graphs, Triton kernels."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from weir.platform import Platform

logger = logging.getLogger(__name__)


class TorchCudaPlatformBase(Platform):
    """Shared by CUDA and ROCm: both run through ``torch.cuda`` (device type "cuda").

    A torch build is either CUDA or ROCm, told apart by ``torch.version.hip``.
    """

    device_type = "cuda"
    supports_graphs = True
    supports_triton = True
    pin_memory = True
    # triton_mla, the Triton MLA / DSA backend, is skipped while it is not registered.
    preferred_attention_backends = ("triton", "gdn_fla", "triton_mla", "kda_fla",
                                    "torch", "gdn_torch", "mla_torch", "kda_torch")
    preferred_moe_backends = ("triton", "torch")

    @staticmethod
    def _torch_cuda_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def _torch_hip_version() -> str | None:
        return torch.version.hip

    def start_device_setup(self) -> Callable[[], None]:
        # The CUDA context and Triton's launcher helper (a C module Triton compiles with gcc on a
        # cold machine) take time at a cold start that needs no config; reading the config
        # (transformers' imports) took 10-13 s on the H200 machine.
        thread = threading.Thread(target=_set_up_device, args=(self.device(),), name="weir-device-setup",
                                  daemon=True)
        thread.start()
        return thread.join

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        # Blocks torch's caching allocator holds but no tensor uses (an engine freed earlier in
        # this process, say) are this process's to reuse: count them as free.
        unused_cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return free + unused_cached, total

    def synchronize(self, index: int = 0) -> None:
        torch.cuda.synchronize(index)


def _set_up_device(device: torch.device) -> None:
    try:
        torch.zeros(1, device=device)
        from triton.runtime import driver

        driver.active.get_current_device()
        from triton.runtime import cache

        # The first compilation's cache key hashes Triton's own sources and libtriton (hundreds
        # of MB): 0.7 s on the main thread at the H200's cold start, mostly outside the GIL here.
        getattr(cache, "triton_key", lambda: None)()
    except Exception:  # noqa: BLE001 - the engine meets the same failure later and reports it there
        logger.debug("background device set-up failed", exc_info=True)


class CudaPlatform(TorchCudaPlatformBase):
    name = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return cls._torch_hip_version() is None and cls._torch_cuda_available()

    @classmethod
    def unavailable_reason(cls) -> str:
        hip_version = cls._torch_hip_version()
        if hip_version is not None:
            return f"torch is a ROCm build (HIP {hip_version}); use device 'rocm'"
        if not cls._torch_cuda_available():
            return "torch reports no CUDA device (torch.cuda.is_available() is False)"
        return ""
