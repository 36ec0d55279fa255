"""RMSNorm flavours with Hugging Face semantics, optionally fused with the residual add.

On CUDA one Triton kernel (``weir.kernels.triton_layers``) does the add and the norm; elsewhere,
or with ``WEIR_DISABLE_TRITON=1``, the torch code below runs and stays the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from weir.kernels.dispatch import triton_module, use_triton


def _kernel_fits(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Layouts the Triton kernel takes: unit-stride rows of a 2-D or 3-D ``x``; a residual with
    x's 2-D shape and dtype and unit-stride rows (it is written in place)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or x.numel() == 0:
        return False
    if residual is None:
        return True
    return (x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.stride(-1) == 1)


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
        the reference's pre-norm blocks exactly. On the Triton path the sum is written into
        ``residual`` in place (as vLLM does) and that tensor is returned: callers must not keep
        the old residual for anything else.
        """
        if use_triton(x) and _kernel_fits(x, residual):
            return triton_module("triton_layers").rms_norm_triton(x, self.weight, self.eps, residual)
        if residual is None:
            return self._normalize(x)
        summed = residual + x  # [..., hidden]
        return self._normalize(summed), summed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ZeroCenteredRMSNorm(RMSNorm):
    """``((1 + w) * x / rms(x))``, all in fp32, cast once at the end (``Qwen3NextRMSNorm``).

    The weight is stored zero-centred (a checkpoint's zeros mean identity); unlike the Llama
    flavour, the normalised value is not rounded before the weight multiplies.
    """

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(-1, keepdim=True)
        return (x_fp32 * torch.rsqrt(variance + self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``RMSNorm.forward`` (same residual contract), with the zero-centred weight."""
        if use_triton(x) and _kernel_fits(x, residual):
            return triton_module("triton_layers").rms_norm_triton(x, self.weight, self.eps, residual,
                                                                  zero_centered=True)
        if residual is None:
            return self._normalize(x)
        summed = residual + x  # [..., hidden]
        return self._normalize(summed), summed


class GatedRMSNorm(nn.Module):
    """Norm, then gate: ``(w * (x / rms(x)).to(dtype)) * silu(z)`` per row (``Qwen3NextRMSNormGated``).

    The weight is a plain (not zero-centred) scale; the gate product runs in fp32 and is cast
    back to x's dtype once.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [num_tokens, num_heads, hidden] (the Triton kernel's layout) or any [..., hidden]
        if use_triton(x) and x.dim() == 3 and gate.shape == x.shape and x.stride(-1) == 1 and gate.stride(-1) == 1:
            return triton_module("triton_gated").gated_rms_norm_triton(x, gate, self.weight, self.eps)
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(-1, keepdim=True)
        normed = self.weight * (x_fp32 * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return (normed * torch.nn.functional.silu(gate.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """Norm, then a sigmoid gate, all in fp32: ``(w * x / rms(x) * sigmoid(gate)).to(dtype)`` per row
    (Kimi Linear's output norm, ``KimiLinearRMSNormGated``). Unlike ``GatedRMSNorm`` nothing is
    rounded before the gate multiplies, and the weight is used in fp32."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., hidden]
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(-1, keepdim=True)
        normed = self.weight.float() * (x_fp32 * torch.rsqrt(variance + self.eps))
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)
