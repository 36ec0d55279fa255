"""Reference MoE in plain torch ops: tokens grouped by expert, one matmul pair per expert.

It runs on every platform and is the oracle fused backends are tested against. Only experts
that received tokens are visited, so a decode batch touching 8 of 512 experts does 8 matmuls.
"""

from __future__ import annotations

import torch

from weir.moe import MoEBackend, activation_fn


class TorchMoEBackend(MoEBackend):
    name = "torch"
    supported_devices = frozenset({"cpu", "cuda", "xpu"})

    def experts(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k]
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
        w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
        w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
        activation: str = "silu",
    ) -> torch.Tensor:  # [num_tokens, hidden]
        act = activation_fn(activation)
        num_experts = w_gate_up.shape[0]
        top_k = topk_ids.shape[-1]
        output = torch.zeros_like(hidden)  # [num_tokens, hidden]

        # Sort the (token, slot) assignments by expert so each expert's tokens are contiguous.
        flat_expert_ids = topk_ids.reshape(-1)  # [num_tokens * top_k]
        assignment_order = torch.argsort(flat_expert_ids, stable=True)
        tokens_per_expert = torch.bincount(flat_expert_ids, minlength=num_experts)
        # One host sync for the group sizes; acceptable in the reference backend.
        group_sizes = tokens_per_expert.tolist()
        flat_weights = topk_weights.reshape(-1).to(hidden.dtype)  # [num_tokens * top_k]

        group_start = 0
        for expert_id, group_size in enumerate(group_sizes):
            if group_size == 0:
                continue
            assignments = assignment_order[group_start : group_start + group_size]
            group_start += group_size
            token_ids = assignments // top_k  # [group_size]
            expert_input = hidden[token_ids]  # [group_size, hidden]
            gate_up = expert_input @ w_gate_up[expert_id].T  # [group_size, 2 * intermediate]
            gate, up = gate_up.chunk(2, dim=-1)  # gate rows come first in w_gate_up
            expert_output = (act(gate) * up) @ w_down[expert_id].T  # [group_size, hidden]
            weighted = expert_output * flat_weights[assignments, None]
            output.index_add_(0, token_ids, weighted)
        return output
