"""The Intel XPU platform: ``torch.xpu``, XCCL collectives, no device graphs."""

from __future__ import annotations

import torch

from weir.platform import Platform


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl"
    supports_graphs = False
    supports_triton = True
    pin_memory = True
    preferred_attention_backends = ("torch", "gdn_torch", "mla_torch", "kda_torch")
    preferred_moe_backends = ("torch",)

    @staticmethod
    def _torch_xpu_available() -> bool:
        # Older torch builds have no torch.xpu module at all.
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    @classmethod
    def is_available(cls) -> bool:
        return cls._torch_xpu_available()

    @classmethod
    def unavailable_reason(cls) -> str:
        if not cls._torch_xpu_available():
            return "torch reports no XPU device (torch.xpu is missing or not available)"
        return ""

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        return torch.xpu.mem_get_info(index)

    def synchronize(self, index: int = 0) -> None:
        torch.xpu.synchronize(index)
