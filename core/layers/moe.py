"""Expert weights in the fused transformers 5.x layout, computed by the selected MoE backend."""

from __future__ import annotations

import torch
from torch import nn

from weir.layer_cache import ForwardContext
from weir.moe import MoEBackend, Routing, activation_fn

# Per-expert checkpoint tensors (what ``save_pretrained`` writes) -> shards of the fused expert
# parameters; for a model's ``stacked_param_patterns`` (regex, parameter, shard id).
PER_EXPERT_PATTERNS: tuple[tuple[str, str, str], ...] = (
    (r"\.experts\.(\d+)\.gate_proj\.weight$", ".experts.gate_up_proj", r"gate.\1"),
    (r"\.experts\.(\d+)\.up_proj\.weight$", ".experts.gate_up_proj", r"up.\1"),
    (r"\.experts\.(\d+)\.down_proj\.weight$", ".experts.down_proj", r"down.\1"),
)


class FusedExperts(nn.Module):
    """``gate_up_proj [E + S, 2I, H]`` (gate rows, then up rows) and ``down_proj [E + S, H, I]``:
    ``E = num_experts`` routed experts, then ``S = num_shared_experts`` shared ones, reached as
    ``routing`` (``weir.moe.Routing``, built once by the model from its config) says.

    The routed experts load from per-expert checkpoint tensors (shards ``gate.e``, ``up.e``,
    ``down.e``) or from the fused tensors whole (``whole_slice``). Shared experts are checkpoint
    MLPs of the model's own naming: the model loads them as such and copies them in with
    ``load_shared_expert``. ``forward`` takes router logits and calls the context's backend.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 num_shared_experts: int = 0, *, routing: Routing):
        super().__init__()
        if not isinstance(routing, Routing):
            raise ValueError(f"routing must be a weir.moe.Routing, got {type(routing).__name__}")
        if routing.num_experts != num_experts:
            raise ValueError(f"the routing chooses among {routing.num_experts} experts, but the layer has "
                             f"{num_experts} routed experts")
        activation_fn(activation)  # an unknown name fails when the model is built, not at its first step
        self.num_experts = num_experts
        self.num_shared_experts = num_shared_experts
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.routing = routing
        total = num_experts + num_shared_experts
        self.gate_up_proj = nn.Parameter(torch.empty(total, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(total, hidden_size, intermediate_size))

    def param_shard_ids(self, attr: str) -> tuple[str, ...]:
        experts = range(self.num_experts)
        if attr == "gate_up_proj":
            return tuple(f"gate.{e}" for e in experts) + tuple(f"up.{e}" for e in experts)
        return tuple(f"down.{e}" for e in experts)

    def checkpoint_suffix(self, shard_id: str) -> str:
        """The per-expert checkpoint name of a shard, relative to this module: ``up.5`` -> ``5.up_proj.weight``."""
        kind, _, expert = shard_id.partition(".")
        return f"{expert}.{kind}_proj.weight"

    def whole_slice(self, attr: str) -> slice:
        """The part of a parameter that a whole (fused-layout) checkpoint tensor fills: the routed experts."""
        return slice(0, self.num_experts)

    @torch.no_grad()
    def load_shared_expert(self, index: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy shared expert ``index`` in: ``gate_up [2I, H]`` (gate rows first), ``down [H, I]``."""
        if not 0 <= index < self.num_shared_experts:
            raise IndexError(f"shared expert {index} of {self.num_shared_experts}")
        expected = (tuple(self.gate_up_proj.shape[1:]), tuple(self.down_proj.shape[1:]))
        if (tuple(gate_up.shape), tuple(down.shape)) != expected:
            raise ValueError(f"shared expert weights {tuple(gate_up.shape)} and {tuple(down.shape)} do not match "
                             f"the experts' {expected[0]} and {expected[1]}")
        self.gate_up_proj[self.num_experts + index].copy_(gate_up)
        self.down_proj[self.num_experts + index].copy_(down)

    def shard_slice(self, shard_id: str) -> tuple:
        """Index of shard ``kind.expert`` in its parameter."""
        kind, _, expert = shard_id.partition(".")
        expert_idx = int(expert)
        if kind == "gate":
            return (expert_idx, slice(0, self.intermediate_size))
        if kind == "up":
            return (expert_idx, slice(self.intermediate_size, 2 * self.intermediate_size))
        return (expert_idx,)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
        ctx: ForwardContext,
        shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared_experts]
        correction_bias: torch.Tensor | None = None,  # [num_experts]: the routing's, when it uses one
    ) -> torch.Tensor:  # [num_tokens, hidden]: routed experts plus (gated) shared experts
        """``shared_gate_logits`` weigh the shared experts (``sigmoid``; 1 without them);
        ``correction_bias`` is the layer's ``e_score_correction_bias`` for
        ``sigmoid_grouped_top_k`` routing (a parameter the model owns and loads)."""
        if ctx.moe_backend is None:
            raise RuntimeError("this model has MoE layers, but the forward context has no MoE backend")
        backend = ctx.moe_backend
        try:
            out = backend.forward(hidden_states, router_logits, self.gate_up_proj, self.down_proj,
                                  routing=self.routing, activation=self.activation, correction_bias=correction_bias,
                                  num_shared_experts=self.num_shared_experts, shared_gate_logits=shared_gate_logits)
        except TypeError as error:
            if type(backend).forward is not MoEBackend.forward and "keyword argument" in str(error):
                raise TypeError(f"MoE backend {backend.name!r} overrides forward with another signature than "
                                f"weir.moe.MoEBackend.forward(hidden, router_logits, w_gate_up, w_down, routing, "
                                f"activation, correction_bias, num_shared_experts, shared_gate_logits): "
                                f"{error}") from error
            raise
        if out.shape != hidden_states.shape or out.dtype != hidden_states.dtype:
            raise RuntimeError(f"MoE backend {backend.name!r} returned {out.dtype} {tuple(out.shape)}; expected "
                               f"{hidden_states.dtype} {tuple(hidden_states.shape)} (tokens, hidden)")
        return out

    def extra_repr(self) -> str:
        hidden = self.down_proj.shape[1]
        return (f"experts={self.num_experts}, shared={self.num_shared_experts}, hidden={hidden}, "
                f"intermediate={self.intermediate_size}, routing={self.routing}")
