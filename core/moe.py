"""The MoE-backend interface: route a layer's tokens to experts, then compute the experts.

Expert weights use the fused layout of transformers 5.x MoE modules:
``w_gate_up [num_experts, 2 * intermediate, hidden]`` with the gate rows first, then the up
rows, and ``w_down [num_experts, hidden, intermediate]``. Each expert computes
``down(act(gate(x)) * up(x))``; a token's output is the routing-weighted sum over its top-k.
How a layer's router logits choose and weigh the top-k is the layer's ``Routing``; the torch
functions here (``route_reference``) are the oracle every backend's routing is held to.
Shared experts as wide as the routed ones may follow them in the same tensors: every token then
takes them in extra slots after its top-k (``append_shared_experts``), so one grouped-GEMM pass
computes both.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The one table of the gated MLPs' activations, dense (weir.layers.mlp) and expert: hidden_act
# names as transformers' ACT2FN spells them ("gelu" is the exact erf form).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


def activation_fn(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``ACTIVATIONS`` names ``activation``; ``ValueError`` listing the known names."""
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown activation {activation!r}; known: {', '.join(sorted(ACTIVATIONS))}"
        ) from None


SOFTMAX_TOP_K = "softmax_top_k"
TOP_K_SOFTMAX = "top_k_softmax"
SIGMOID_GROUPED_TOP_K = "sigmoid_grouped_top_k"
ROUTING_METHODS = (SOFTMAX_TOP_K, TOP_K_SOFTMAX, SIGMOID_GROUPED_TOP_K)


@dataclass(frozen=True)
class Routing:
    """How a layer's router logits choose each token's ``top_k`` experts and weigh them.

    Built once per MoE layer from its config (the constructors below name the transformers
    fields) and checked here, so a bad config fails when the model is built. Every method
    casts the logits to fp32 first, whatever their dtype, computes in fp32 and returns fp32
    weights (``route_reference``):

    - ``softmax_top_k`` (Qwen3-MoE, Qwen3-Next): ``p = softmax(logits)`` over all experts; the
      ``top_k`` largest ``p``, divided by their sum when ``renormalize`` (``norm_topk_prob``).
    - ``top_k_softmax`` (Mixtral, GraniteMoe, GraniteMoe SWA): the ``top_k`` largest logits,
      weighted by the softmax over those ``k`` logits alone. Mathematically ``softmax_top_k``
      with ``renormalize``; the rounding differs.
    - ``sigmoid_grouped_top_k`` (DeepSeek-V3, Kimi Linear, Kimi K2; transformers'
      ``DeepseekV3TopkRouter``): scores ``s = sigmoid(logits)``; choice scores
      ``c = s + correction_bias`` (the layer's ``e_score_correction_bias [num_experts]``). The
      experts form ``num_groups`` (``n_group``) consecutive groups of equal size; a group's score
      is the sum of its two largest ``c``; the ``top_k_groups`` (``topk_group``) best groups are
      kept and every other expert is out. The ``top_k`` largest ``c`` among the kept experts
      are chosen; their weights are their ``s`` (without the bias), divided by ``sum + 1e-20``
      when ``renormalize``, then multiplied by ``routed_scaling_factor`` (the shared experts'
      slots are not scaled). transformers computes the router GEMM in fp32 too, and keeps the
      bias fp32: a model matching it passes fp32 logits and an fp32 bias.

    Experts whose scores tie may be chosen in either order of ids; which one a backend keeps at
    the ``top_k`` boundary is its own.
    """

    method: str
    num_experts: int
    top_k: int
    renormalize: bool = False
    num_groups: int = 1
    top_k_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in ROUTING_METHODS:
            raise ValueError(f"unknown routing method {self.method!r}; known: {', '.join(ROUTING_METHODS)}")
        for name in ("num_experts", "top_k", "num_groups", "top_k_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"routing {name} must be an int, got {value!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"routing renormalize must be a bool, got {self.renormalize!r}")
        if self.num_experts < 1:
            raise ValueError(f"a routed MoE layer needs at least one expert, got num_experts={self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}] (the number of experts), got {self.top_k}")
        if self.method == SIGMOID_GROUPED_TOP_K:
            self._check_groups()
            return
        if (self.num_groups, self.top_k_groups, self.routed_scaling_factor) != (1, 1, 1.0):
            raise ValueError(f"{self.method} routing has no expert groups or scaling factor (those are "
                             f"{SIGMOID_GROUPED_TOP_K}'s), got num_groups={self.num_groups}, "
                             f"top_k_groups={self.top_k_groups}, routed_scaling_factor={self.routed_scaling_factor}")
        if self.method == TOP_K_SOFTMAX and self.renormalize:
            raise ValueError(f"{TOP_K_SOFTMAX} weights already sum to 1: renormalize applies to {SOFTMAX_TOP_K} "
                             f"and {SIGMOID_GROUPED_TOP_K} only")

    def _check_groups(self) -> None:
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"num_groups (n_group) must divide the {self.num_experts} experts into equal groups, "
                             f"got {self.num_groups}")
        if not 1 <= self.top_k_groups <= self.num_groups:
            raise ValueError(f"top_k_groups (topk_group) must be in [1, {self.num_groups}] (num_groups), "
                             f"got {self.top_k_groups}")
        group_size = self.num_experts // self.num_groups
        if self.top_k_groups < self.num_groups and group_size < 2:
            raise ValueError(f"a group's score sums its two best experts, but {self.num_groups} groups of "
                             f"{self.num_experts} experts hold {group_size} each")
        if self.top_k > self.top_k_groups * group_size:
            raise ValueError(f"top_k={self.top_k} exceeds the {self.top_k_groups * group_size} experts of the "
                             f"{self.top_k_groups} kept groups ({group_size} experts each)")
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor)
                                                                                   and factor > 0):
            raise ValueError(f"routed_scaling_factor must be a positive finite number, got {factor!r}")

    @classmethod
    def softmax_top_k(cls, num_experts: int, top_k: int, renormalize: bool) -> Routing:
        """Qwen3-MoE / Qwen3-Next: ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob``."""
        return cls(SOFTMAX_TOP_K, num_experts, top_k, renormalize)

    @classmethod
    def top_k_softmax(cls, num_experts: int, top_k: int) -> Routing:
        """Mixtral / GraniteMoe (SWA): ``num_local_experts``, ``num_experts_per_tok``."""
        return cls(TOP_K_SOFTMAX, num_experts, top_k)

    @classmethod
    def sigmoid_grouped_top_k(cls, num_experts: int, top_k: int, num_groups: int, top_k_groups: int,
                              renormalize: bool, routed_scaling_factor: float) -> Routing:
        """DeepSeek-V3 / Kimi: ``n_routed_experts``, ``num_experts_per_tok``, ``n_group``,
        ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``."""
        return cls(SIGMOID_GROUPED_TOP_K, num_experts, top_k, renormalize, num_groups, top_k_groups,
                   float(routed_scaling_factor))

    @property
    def uses_correction_bias(self) -> bool:
        """Whether routing takes the layer's ``correction_bias [num_experts]``."""
        return self.method == SIGMOID_GROUPED_TOP_K


def check_router_inputs(router_logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless the logits are ``[num_tokens, routing.num_experts]`` floats and a
    correction bias ``[num_experts]`` is given exactly when the routing uses one (shapes only:
    nothing is read from the device)."""
    if not isinstance(routing, Routing):
        raise ValueError(f"routing must be a weir.moe.Routing, got {type(routing).__name__}")
    if router_logits.dim() != 2 or router_logits.shape[1] != routing.num_experts:
        raise ValueError(f"router_logits must be [num_tokens, {routing.num_experts}] (the routed experts), "
                         f"got {tuple(router_logits.shape)}")
    if not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be floats, got {router_logits.dtype}")
    if not routing.uses_correction_bias:
        if correction_bias is not None:
            raise ValueError(f"{routing.method} routing takes no correction_bias (only {SIGMOID_GROUPED_TOP_K} does)")
        return
    if correction_bias is None:
        raise ValueError(f"{SIGMOID_GROUPED_TOP_K} routing needs the layer's correction_bias "
                         f"[{routing.num_experts}] (e_score_correction_bias; zeros for a model without one)")
    if tuple(correction_bias.shape) != (routing.num_experts,) or not correction_bias.is_floating_point():
        raise ValueError(f"correction_bias must be float [{routing.num_experts}], got {correction_bias.dtype} "
                         f"{tuple(correction_bias.shape)}")


def softmax_top_k(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32, ids int64: [num_tokens, top_k] each
    """``softmax_top_k`` routing: fp32 softmax over all experts, the ``top_k`` largest, divided
    by their sum when ``renormalize``. Weights come out sorted descending."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    routing_probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [num_tokens, num_experts]
    topk_weights, topk_ids = torch.topk(routing_probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def top_k_softmax(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32, ids int64: [num_tokens, top_k] each
    """``top_k_softmax`` routing: the ``top_k`` largest fp32 logits, then the fp32 softmax over
    those alone (transformers' ``GraniteMoeSWATopKRouter``). Weights come out sorted descending."""
    topk_logits, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)  # [num_tokens, top_k] each
    return torch.softmax(topk_logits, dim=-1), topk_ids


def sigmoid_grouped_top_k(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    correction_bias: torch.Tensor,  # [num_experts]
    routing: Routing,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32, ids int64: [num_tokens, top_k] each
    """``sigmoid_grouped_top_k`` routing (``Routing`` says what it computes), in torch ops that
    never read the device on the host, so it runs inside CUDA graphs too."""
    num_tokens, num_experts = router_logits.shape
    scores = torch.sigmoid(router_logits.float())  # [num_tokens, num_experts]
    choice_scores = scores + correction_bias.float()
    if routing.top_k_groups < routing.num_groups:  # with every group kept, the group step masks nothing
        grouped = choice_scores.view(num_tokens, routing.num_groups, num_experts // routing.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [num_tokens, num_groups]
        kept_groups = torch.topk(group_scores, routing.top_k_groups, dim=-1).indices
        group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        expert_kept = group_kept[:, :, None].expand(grouped.shape).reshape(num_tokens, num_experts)
        choice_scores = choice_scores.masked_fill(~expert_kept, float("-inf"))
    topk_ids = torch.topk(choice_scores, routing.top_k, dim=-1).indices  # [num_tokens, top_k]
    topk_weights = scores.gather(1, topk_ids)
    if routing.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routing.routed_scaling_factor, topk_ids


def route_reference(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    routing: Routing,
    correction_bias: torch.Tensor | None = None,  # [num_experts], sigmoid_grouped_top_k only
) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32, ids int64: [num_tokens, top_k] each
    """Each token's ``routing.top_k`` experts and their weights, in torch: the oracle of every
    backend's ``route``."""
    check_router_inputs(router_logits, routing, correction_bias)
    if routing.method == SOFTMAX_TOP_K:
        return softmax_top_k(router_logits, routing.top_k, routing.renormalize)
    if routing.method == TOP_K_SOFTMAX:
        return top_k_softmax(router_logits, routing.top_k)
    return sigmoid_grouped_top_k(router_logits, correction_bias, routing)


class MoEBackend(ABC):
    """A way to compute mixture-of-experts layers.

    ``forward`` routes (``route``: the layer's ``Routing``, then one slot per shared expert) and
    then calls ``experts``. A backend may override ``route`` with fused kernels (falling back to
    the base class for methods it has none for), or ``forward`` to route inside its expert
    kernels, taking every argument of ``forward`` below. ``weir.testing.check_moe_backend``
    holds a backend to the torch reference over every routing method, with and without shared
    experts.

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
        routing: Routing,
        activation: str = "silu",
        correction_bias: torch.Tensor | None = None,  # [num_routed_experts], sigmoid_grouped_top_k only
        num_shared_experts: int = 0,
        shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared_experts]
    ) -> torch.Tensor:  # [num_tokens, hidden], in hidden's dtype
        """Route each token to ``routing.top_k`` experts as ``routing`` says (``Routing``), then the experts.

        The last ``num_shared_experts`` experts of the weights are shared experts: every token
        uses each of them, weighted ``sigmoid(shared_gate_logits)`` (1 without gate logits), as
        if routed there in extra top-k slots. Computing them in the same grouped kernels spares a
        dense MLP, its gate and the final sum per layer.
        """
        check_router_inputs(router_logits, routing, correction_bias)
        if w_gate_up.shape[0] != routing.num_experts + num_shared_experts:
            raise ValueError(f"expert weights hold {w_gate_up.shape[0]} experts, but the routing has "
                             f"{routing.num_experts} and {num_shared_experts} are shared")
        if shared_gate_logits is not None and not num_shared_experts:
            raise ValueError("shared_gate_logits were given, but num_shared_experts is 0")
        topk_weights, topk_ids = self.route(router_logits, routing, correction_bias, num_shared_experts,
                                            shared_gate_logits)
        return self.experts(hidden, topk_weights, topk_ids, w_gate_up, w_down, activation)

    def route(
        self,
        router_logits: torch.Tensor,  # [num_tokens, num_routed_experts]
        routing: Routing,
        correction_bias: torch.Tensor | None = None,  # [num_routed_experts], sigmoid_grouped_top_k only
        num_shared_experts: int = 0,
        shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared_experts]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32, integer ids: [num_tokens, top_k + num_shared_experts]
        """``route_reference``, then one slot per shared expert (``append_shared_experts``); a
        backend may compute the same in fused kernels."""
        if shared_gate_logits is not None:
            check_shared_gate_logits(shared_gate_logits, router_logits.shape[0], num_shared_experts)
        topk_weights, topk_ids = route_reference(router_logits, routing, correction_bias)
        if not num_shared_experts:
            return topk_weights, topk_ids
        return append_shared_experts(topk_weights, topk_ids, routing.num_experts, num_shared_experts,
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
        """Sum over each token's slots of ``weight * down(act(gate(x)) * up(x))``, ``act`` from
        ``ACTIVATIONS``; shared-expert slots (``append_shared_experts``) are computed like routed
        ones."""


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
