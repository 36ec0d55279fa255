"""The gated MLP of Llama-style decoders: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weir.kernels.dispatch import triton_module, use_triton
from weir.layers.linear import Linear, MergedLinear
from weir.moe import ACTIVATIONS


class GatedMLP(nn.Module):
    """gate and up fused into ``gate_up_proj`` (shards ``"gate"``, ``"up"``), then ``down_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 bias: bool = False):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={hidden_act!r} is not supported by GatedMLP; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        self.act_fn = ACTIVATIONS[hidden_act]
        # SiLU has a fused Triton kernel (activation and product in one pass) on CUDA.
        self.fused_silu = self.act_fn is F.silu
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.fused_silu and use_triton(gate_up) and gate_up.stride(-1) == 1:
            activated = triton_module("triton_layers").silu_and_mul_triton(gate_up)
        else:
            gate, up = self.gate_up_proj.split(gate_up)  # each [num_tokens, intermediate]
            activated = self.act_fn(gate) * up
        return self.down_proj(activated)  # [num_tokens, hidden]
