"""The Gated DeltaNet gates, as transformers' Qwen3-Next computes them: per token and value
head, the log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, <= 0) and the write
strength ``beta = sigmoid(b)``. On CUDA one Triton kernel computes both (``weir.kernels.triton_gated``).
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
