"""Triton kernels for gated linear-attention layers: the gated RMSNorm (norm, then ``silu(z)``)
and the Gated DeltaNet gates (``g``, ``beta``). Each replaces a chain of small torch ops that
cost more in launches than in bytes at decode batch sizes.

The torch versions (``weir.layers.norm.GatedRMSNorm``, ``weir.layers.gates.delta_net_gates``) are
the oracles; the kernels round where torch rounds. Grids come from shapes only (graph-safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, x_stride_token, x_stride_head,  # [num_tokens, num_heads, head_dim]
    z_ptr, z_stride_token, z_stride_head,  # the gate, same shape (may be a strided view)
    weight_ptr,  # [head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    num_rows, num_heads, head_dim, eps,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] = (token, head) pairs
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < head_dim)[None, :]
    token, head = rows // num_heads, rows % num_heads
    x = tl.load(x_ptr + (token * x_stride_token + head * x_stride_head)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    z = tl.load(z_ptr + (token * z_stride_token + head * z_stride_head)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    variance = tl.math.div_rn(tl.sum(x * x, axis=1), head_dim.to(tl.float32))
    normed = (x * tl.math.rsqrt(variance + eps)[:, None]).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=cols < head_dim, other=0.0).to(tl.float32)
    # torch: (w * normed) in the model dtype, then times silu(z) in fp32, one final rounding.
    scaled = (weight[None, :] * normed.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = scaled * tl.math.div_rn(z, 1.0 + tl.exp(-z))
    tl.store(out_ptr + rows[:, None] * head_dim + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``GatedRMSNorm.forward`` for ``x``, ``gate`` ``[num_tokens, num_heads, head_dim]`` (unit last stride)."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(head_dim)
    rows_per_program = max(1, min(32, 4096 // block))
    _gated_rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x, x.stride(0), x.stride(1), gate, gate.stride(0), gate.stride(1), weight, out,
        num_rows, num_heads, head_dim, eps, ROWS=rows_per_program, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _delta_net_gates_kernel(
    a_ptr, b_ptr, stride_token,  # [num_tokens, num_heads] views of one projection output
    a_log_ptr, dt_bias_ptr,  # [num_heads]
    g_ptr, beta_ptr,  # [num_tokens, num_heads], contiguous
    num_heads,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK)
    mask = heads < num_heads
    a = tl.load(a_ptr + token * stride_token + heads, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + token * stride_token + heads, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    shifted = a + dt_bias
    softplus = tl.where(shifted > 20.0, shifted, tl.log(1.0 + tl.exp(shifted)))  # torch's threshold
    tl.store(g_ptr + token * num_heads + heads, -tl.exp(a_log) * softplus, mask=mask)
    beta = tl.math.div_rn(1.0, 1.0 + tl.exp(-b))
    tl.store(beta_ptr + token * num_heads + heads, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def delta_net_gates_triton(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                           dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_net_gates`` for ``a``, ``b`` ``[num_tokens, num_heads]`` sharing one row stride."""
    num_tokens, num_heads = a.shape
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, num_heads, dtype=b.dtype, device=b.device)
    if num_tokens:
        _delta_net_gates_kernel[(num_tokens,)](a, b, a.stride(0), a_log, dt_bias, g, beta, num_heads,
                                               BLOCK=triton.next_power_of_2(num_heads), num_warps=1)
    return g, beta
