"""The Gated DeltaNet gates, as transformers' Qwen3-Next computes them: per token and value
head, the log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, <= 0) and the write
strength ``beta = sigmoid(b)``. On CUDA one Triton kernel computes both (``weir.kernels.triton_gated``).
Kimi Delta Attention's forget gate (``kimi_delta_gate``) has the same form with one decay per key
channel instead of one per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weir.kernels.dispatch import triton_module, use_triton


def delta_net_gates(
    a: torch.Tensor,  # [num_tokens, num_v_heads], model dtype
    b: torch.Tensor,  # [num_tokens, num_v_heads], model dtype
    a_log: torch.Tensor,  # [num_v_heads]
    dt_bias: torch.Tensor,  # [num_v_heads]
) -> tuple[torch.Tensor, torch.Tensor]:  # g fp32, beta in b's dtype; both [num_tokens, num_v_heads]
    if use_triton(a) and a.stride(-1) == 1 and b.stride(-1) == 1 and a.stride(0) == b.stride(0):
        return triton_module("triton_gated").delta_net_gates_triton(a, b, a_log, dt_bias)
    # fp32 before exp/softplus: in half precision the decay can underflow to -inf.
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def kimi_delta_gate(
    f: torch.Tensor,  # [num_tokens, num_heads * head_dim]: f_b_proj(f_a_proj(x)), model dtype
    a_log: torch.Tensor,  # [num_heads] (any shape holding num_heads values)
    dt_bias: torch.Tensor,  # [num_heads * head_dim]
    num_heads: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] fp32 log-decay (<= 0)
    """Kimi Delta Attention's forget gate, one log-decay per key channel (transformers'
    ``KimiLinearForgetGate``): ``g = -exp(A_log[h]) * softplus(f + dt_bias)``, all in fp32."""
    num_tokens = f.shape[0]
    per_channel = (f.float() + dt_bias.float()).view(num_tokens, num_heads, -1)  # [T, H, K]
    return -a_log.float().reshape(num_heads, 1).exp() * F.softplus(per_channel)
