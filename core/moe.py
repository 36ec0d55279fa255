"""The MoE-backend interface: compute a layer's experts for a batch of tokens.

Expert weights use the fused layout of transformers 5.x MoE modules:
``w_gate_up [num_experts, 2 * intermediate, hidden]`` with the gate rows first, then the up
rows, and ``w_down [num_experts, hidden, intermediate]``. Each expert computes
``down(act(gate(x)) * up(x))``; a token's output is the routing-weighted sum over its top-k.
Shared experts as wide as the routed ones may follow them in the same tensors: every token then
takes them in extra slots after its top-k (``append_shared_experts``), so one grouped-GEMM pass
computes both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
}


def activation_fn(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown MoE activation {activation!r}; known: {', '.join(sorted(ACTIVATIONS))}"
        ) from None


def softmax_top_k(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: (weights [num_tokens, top_k] fp32, expert ids [num_tokens, top_k]).

    The softmax runs in fp32 as transformers does, so bf16 logits route the same way.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    routing_probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(routing_probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class MoEBackend(ABC):
    """A way to compute mixture-of-experts layers.

    ``forward`` routes (``route``: softmax, top-k, optional renormalisation of the top-k weights)
    and then calls ``experts``. Models with their own routing (sigmoid scores, grouped top-k,
    bias correction) compute weights and ids themselves and call ``experts`` directly. A backend
    may override ``route`` with a fused kernel, or ``forward`` to route inside its expert kernels
    (taking every argument of ``forward`` below: models with shared experts pass them).

    Registered through the ``weir_moe_backends`` hook (``MoEBackendSpec``, whose ``name`` should
    equal the class's ``name``) and constructed with no arguments, once per engine.
    """

    name: ClassVar[str]
    supported_devices: ClassVar[frozenset[str]]
    # No host reads of device values and launch grids fixed by the token count: capturable.
    supports_cuda_graphs: ClassVar[bool] = False

    @classmethod
    def supports(cls, device_type: str) -> bool:
        """Whether the backend runs on this device type."""
        return device_type in cls.supported_devices

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend cannot run in this environment (a missing kernel package), or None;
        selection then skips it, or refuses it by name when the user asked for it."""
        return None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        router_logits: torch.Tensor,  # [num_tokens, num_routed_experts]
        w_gate_up: torch.Tensor,  # [num_routed_experts + num_shared_experts, 2 * intermediate, hidden]
        w_down: torch.Tensor,  # [num_routed_experts + num_shared_experts, hidden, intermediate]
        top_k: int,
        renormalize: bool,
        activation: str = "silu",
        num_shared_experts: int = 0,
        shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared_experts]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Softmax routing to ``top_k`` experts (weights renormalised when asked), then the experts.

        The last ``num_shared_experts`` experts of the weights are shared experts: every token
        uses each of them, weighted ``sigmoid(shared_gate_logits)`` (1 without gate logits), as
        if routed there in extra top-k slots. Computing them in the same grouped kernels spares a
        dense MLP, its gate and the final sum per layer.
        """
        num_routed = router_logits.shape[-1]
        if w_gate_up.shape[0] != num_routed + num_shared_experts:
            raise ValueError(f"expert weights hold {w_gate_up.shape[0]} experts, but the router scores "
                             f"{num_routed} and {num_shared_experts} are shared")
        if shared_gate_logits is not None and not num_shared_experts:
            raise ValueError("shared_gate_logits were given, but num_shared_experts is 0")
        if num_shared_experts:
            topk_weights, topk_ids = self.route(router_logits, top_k, renormalize, num_shared_experts,
                                                shared_gate_logits)
        else:
            topk_weights, topk_ids = self.route(router_logits, top_k, renormalize)
        return self.experts(hidden, topk_weights, topk_ids, w_gate_up, w_down, activation)

    def route(
        self,
        router_logits: torch.Tensor,  # [num_tokens, num_routed_experts]
        top_k: int,
        renormalize: bool,
        num_shared_experts: int = 0,
        shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared_experts]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32, integer ids: [num_tokens, top_k + num_shared_experts]
        """``softmax_top_k``, then one slot per shared expert (``append_shared_experts``); a
        backend may compute the same in a fused kernel."""
        if shared_gate_logits is not None:
            check_shared_gate_logits(shared_gate_logits, router_logits.shape[0], num_shared_experts)
        topk_weights, topk_ids = softmax_top_k(router_logits, top_k, renormalize)
        if not num_shared_experts:
            return topk_weights, topk_ids
        return append_shared_experts(topk_weights, topk_ids, router_logits.shape[-1], num_shared_experts,
                                     shared_gate_logits)

    @abstractmethod
    def experts(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, slots] fp32; slots = top_k + num_shared_experts
        topk_ids: torch.Tensor,  # [num_tokens, slots] integer expert ids (int64 from torch.topk)
        w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
        w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
        activation: str = "silu",
    ) -> torch.Tensor:  # [num_tokens, hidden], in hidden's dtype
        """Sum over each token's slots of ``weight * down(act(gate(x)) * up(x))``; shared-expert
        slots (``append_shared_experts``) are computed like routed ones."""


def append_shared_experts(
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    num_routed: int,
    num_shared: int,
    shared_gate_logits: torch.Tensor | None,  # [num_tokens, num_shared]
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k + num_shared] each
    """One more slot per shared expert: ids ``num_routed ..``, weights ``sigmoid(gate logit)`` in
    fp32 (1 without gate logits)."""
    num_tokens = topk_ids.shape[0]
    shared_ids = torch.arange(num_routed, num_routed + num_shared, device=topk_ids.device, dtype=topk_ids.dtype)
    if shared_gate_logits is None:
        shared_weights = topk_weights.new_ones(num_tokens, num_shared)
    else:
        check_shared_gate_logits(shared_gate_logits, num_tokens, num_shared)
        shared_weights = torch.sigmoid(shared_gate_logits.float())
    return (torch.cat([topk_weights, shared_weights], dim=1),
            torch.cat([topk_ids, shared_ids.expand(num_tokens, num_shared)], dim=1))


def check_shared_gate_logits(shared_gate_logits: torch.Tensor, num_tokens: int, num_shared: int) -> None:
    if tuple(shared_gate_logits.shape) != (num_tokens, num_shared):
        raise ValueError(f"shared_gate_logits must be [{num_tokens}, {num_shared}] (tokens, shared experts), "
                         f"got {tuple(shared_gate_logits.shape)}")
