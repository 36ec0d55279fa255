"""RMSNorm with Hugging Face semantics, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``w * (x / rms(x)).to(dtype)``: the statistics in fp32, the scale in the model dtype.

    This is the Llama/Qwen flavour (``LlamaRMSNorm``); the weight multiplies *after* the cast
    back, so bf16 results match transformers bit for bit.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x_fp32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.

        The residual stream stays in the model dtype, added in the same order as transformers
        (``residual + x``), so a decoder written as ``h, residual = norm(h, residual)`` matches
        the reference's pre-norm blocks exactly.
        """
        if residual is None:
            return self._normalize(x)
        summed = residual + x  # [..., hidden]
        return self._normalize(summed), summed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
