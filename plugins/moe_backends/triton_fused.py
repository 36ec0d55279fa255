"""Fused MoE in Triton: the default expert backend on CUDA.

Per layer call: three small alignment kernels group the (token, slot) assignments by expert,
one grouped GEMM computes ``act(gate) * up`` for every assignment, a second applies the down
projection and the routing weight, and a last kernel sums each token's ``top_k`` rows
(``triton_fused_kernels`` has the details). No step reads the device on the host and every
grid depends only on the token count, so a decode batch of fixed size can be captured in a
CUDA graph. Routing, shared-expert slots included, is one more kernel (``triton_routing_kernels``)
for every method: ``softmax_top_k`` and ``top_k_softmax`` in place of torch's five launches,
``sigmoid_grouped_top_k`` (DeepSeek-V3, Kimi) in place of its dozen.
"""

from __future__ import annotations

import torch

from weir.moe import SIGMOID_GROUPED_TOP_K, MoEBackend, Routing, activation_fn
from weir.plugins.moe_backends.triton_fused_kernels import MoETiles, default_moe_tiles, fused_experts
from weir.plugins.moe_backends.triton_routing_kernels import (FUSED_ROUTING_METHODS, sigmoid_grouped_route_triton,
                                                              top_k_route_triton)

# ACTIVATIONS names -> the expert kernel's own (``triton_fused_kernels._activate``).
KERNEL_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


class TritonMoEBackend(MoEBackend):
    """Grouped-GEMM experts over the fused ``w_gate_up [E, 2I, H]`` / ``w_down [E, H, I]`` weights."""

    name = "triton"
    supported_devices = frozenset({"cuda"})
    supports_cuda_graphs = True

    def __init__(self) -> None:
        # Override for tests and the benchmark's tile sweep; None = default_moe_tiles.
        self.tiles: MoETiles | None = None

    def route(
        self,
        router_logits: torch.Tensor,  # [num_tokens, num_routed_experts]
        routing: Routing,
        correction_bias: torch.Tensor | None = None,  # [num_routed_experts], sigmoid_grouped_top_k only
        num_shared_experts: int = 0,
        shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared_experts]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32, integer ids: [num_tokens, top_k + num_shared_experts]
        """The base class's routing and shared-expert slots in one fused kernel (int32 ids); a bias
        given or missing against what the method takes goes to the base class, which names it."""
        if isinstance(routing, Routing):
            if routing.method in FUSED_ROUTING_METHODS and correction_bias is None:
                return top_k_route_triton(router_logits, routing, num_shared_experts, shared_gate_logits)
            if routing.method == SIGMOID_GROUPED_TOP_K and correction_bias is not None:
                return sigmoid_grouped_route_triton(router_logits, correction_bias, routing, num_shared_experts,
                                                    shared_gate_logits)
        return super().route(router_logits, routing, correction_bias, num_shared_experts, shared_gate_logits)

    def experts(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k]
        topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids
        w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
        w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
        activation: str = "silu",
    ) -> torch.Tensor:  # [num_tokens, hidden], in hidden's dtype
        """Sum over each token's experts of ``weight * down(act(gate(x)) * up(x))``.

        Expert ids are not range-checked (that would read the device); an id outside
        ``[0, num_experts)`` contributes nothing.
        """
        activation_fn(activation)  # unknown names fail here, with the list of known ones
        if activation not in KERNEL_ACTIVATIONS:
            raise ValueError(f"the triton MoE backend has no kernel for activation {activation!r}; it has "
                             f"{', '.join(KERNEL_ACTIVATIONS)}")
        check_shapes(hidden, topk_weights, topk_ids, w_gate_up, w_down)
        num_tokens, top_k = topk_ids.shape
        tiles = self.tiles or default_moe_tiles(num_tokens, top_k, w_gate_up.shape[0], hidden.dtype)
        return fused_experts(hidden, topk_weights, topk_ids, w_gate_up, w_down, KERNEL_ACTIVATIONS[activation],
                             tiles)


def check_shapes(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> None:
    """Raise ``ValueError`` unless the operands have the layouts and dtypes the kernels assume."""
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"expected hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]; got "
                         f"{tuple(hidden.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    num_tokens, hidden_size = hidden.shape
    num_experts, hidden_down, intermediate = w_down.shape
    if tuple(w_gate_up.shape) != (num_experts, 2 * intermediate, hidden_size) or hidden_down != hidden_size:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not match "
                         f"hidden size {hidden_size}: expected [E, 2I, H] and [E, H, I]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [{num_tokens}, top_k]")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must hold integer expert ids, got {topk_ids.dtype}")
    if w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype:
        raise ValueError(f"expert weights ({w_gate_up.dtype}, {w_down.dtype}) must have hidden's dtype "
                         f"{hidden.dtype}")
