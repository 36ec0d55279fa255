"""The NVIDIA CUDA platform: NCCL collectives, CUDA graphs, Triton kernels."""

from __future__ import annotations

import torch

from weir.platform import Platform


class TorchCudaPlatformBase(Platform):
    """Shared by CUDA and ROCm: both run through ``torch.cuda`` (device type "cuda").

    A torch build is either CUDA or ROCm, told apart by ``torch.version.hip``.
    """

    device_type = "cuda"
    supports_graphs = True
    supports_triton = True
    pin_memory = True
    preferred_attention_backends = ("triton", "gdn_fla", "torch", "gdn_torch")
    preferred_moe_backends = ("triton", "torch")

    @staticmethod
    def _torch_cuda_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def _torch_hip_version() -> str | None:
        return torch.version.hip

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        # Blocks torch's caching allocator holds but no tensor uses (an engine freed earlier in
        # this process, say) are this process's to reuse: count them as free.
        unused_cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return free + unused_cached, total

    def synchronize(self, index: int = 0) -> None:
        torch.cuda.synchronize(index)


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
