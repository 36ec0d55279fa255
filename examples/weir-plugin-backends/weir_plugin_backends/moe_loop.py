"""Experts one token and one slot at a time: the shortest correct ``weir.moe.MoEBackend``.

Routing (whichever ``weir.moe.Routing`` the layer has, then one slot per shared expert) is the
base class's ``route``; only ``experts`` is written here. Shared experts arrive as extra slots
(ids from the number of routed experts on), so the loop needs no special case for them.
"""

from __future__ import annotations

import torch

from weir.moe import MoEBackend, activation_fn


class LoopMoEBackend(MoEBackend):
    name = "loop_moe"
    supported_devices = frozenset({"cpu"})

    def experts(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, slots] fp32
        topk_ids: torch.Tensor,  # [num_tokens, slots]
        w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
        w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
        activation: str = "silu",
    ) -> torch.Tensor:  # [num_tokens, hidden]
        act = activation_fn(activation)
        intermediate = w_down.shape[-1]
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        expert_ids = topk_ids.tolist()  # a host read per call: fine for a CPU backend
        for token, token_experts in enumerate(expert_ids):
            for slot, expert in enumerate(token_experts):
                gate, up = (w_gate_up[expert] @ hidden[token]).split(intermediate)  # [intermediate] each
                # Round where the reference rounds, so bfloat16 runs match it too.
                activated = (act(gate) * up).to(hidden.dtype)
                expert_out = w_down[expert] @ activated  # [hidden]
                out[token] += topk_weights[token, slot].to(hidden.dtype).float() * expert_out.float()
        return out.to(hidden.dtype)
