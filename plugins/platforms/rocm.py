"""The AMD ROCm platform: torch's HIP build behind the ``torch.cuda`` API, RCCL collectives."""

from __future__ import annotations

from weir.plugins.platforms.cuda import TorchCudaPlatformBase


class RocmPlatform(TorchCudaPlatformBase):
    name = "rocm"
    dist_backend = "rccl"

    @classmethod
    def is_available(cls) -> bool:
        return cls._torch_hip_version() is not None and cls._torch_cuda_available()

    @classmethod
    def unavailable_reason(cls) -> str:
        if cls._torch_hip_version() is None:
            return "torch is not a ROCm build (torch.version.hip is None)"
        if not cls._torch_cuda_available():
            return "torch reports no ROCm device (torch.cuda.is_available() is False)"
        return ""
