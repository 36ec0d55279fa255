"""Granite SWA (``GraniteSWAForCausalLM``) and GraniteMoe SWA (``GraniteMoeSWAForCausalLM``).

Granite decoders with a sliding window on the layers ``layer_types`` marks ``sliding_attention``
(full attention on the others), learnt per-head attention sinks, a RoPE base per layer
(``layer_rope_theta``; 0: no position embedding), ``attention_multiplier`` as the softmax scale,
``embedding_multiplier``, ``residual_multiplier`` on both branches and ``logits_scaling``. The MoE
flavour routes top-k then softmax over the chosen logits, with an optional shared MLP.
transformers' ``modeling_granite_swa`` / ``modeling_granitemoe_swa`` are the reference
(tests/test_granite_swa.py); the maths is in the project's model notes.

The residual multiplier is folded into the weights that produce each branch (``o_proj``, the
MLP's or experts' down projections) once after loading: the branches then come out scaled and
the fused add-and-norm adds them as they are.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from weir.config import ModelConfig
from weir.layer_cache import ForwardContext
from weir.layers import (QKV_GATE_UP_STACKED_PARAMS, GatedMLP, LMHead, Linear, RMSNorm, RopeSelfAttention,
                         RotaryEmbedding, VocabEmbedding, head_dim_of, num_kv_heads_of)
from weir.layers.attention import AttentionLayerSpec, sliding_windows_of
from weir.layers.moe import FusedExperts
from weir.moe import ACTIVATIONS, Routing


def rotary_per_layer(hf_config: Any, head_dim: int, max_positions: int) -> tuple[nn.ModuleList, list[int | None]]:
    """One rotary embedding per distinct non-zero ``layer_rope_theta``, and each layer's index
    into them (None: the layer uses no position embedding)."""
    num_layers = hf_config.num_hidden_layers
    thetas = list(getattr(hf_config, "layer_rope_theta", None) or [])
    if len(thetas) != num_layers:
        raise ValueError(f"layer_rope_theta has {len(thetas)} entries for {num_layers} layers")
    for theta in thetas:
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta < 0:
            raise ValueError(f"layer_rope_theta entries must be numbers >= 0 (0: no RoPE), got {theta!r}")
    distinct = sorted({theta for theta in thetas if theta})
    rotaries = nn.ModuleList()
    for theta in distinct:
        theta_config = copy.deepcopy(hf_config)
        theta_config.rope_parameters = {**(hf_config.rope_parameters or {}), "rope_theta": theta}
        rotaries.append(RotaryEmbedding(theta_config, head_dim, max_positions))
    return rotaries, [distinct.index(theta) if theta else None for theta in thetas]


class SharedMLP(nn.Module):
    """GraniteMoe's shared MLP: ``input_linear [2I, H]`` (gate rows, then up), ``output_linear [H, I]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.act_fn = ACTIVATIONS[activation]
        self.input_linear = Linear(hidden_size, 2 * intermediate_size)
        self.output_linear = Linear(intermediate_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(hidden_states).chunk(2, dim=-1)  # [num_tokens, I] each
        return self.output_linear(self.act_fn(gate) * up)  # [num_tokens, hidden]


class SparseMoeBlock(nn.Module):
    """``block_sparse_moe``: router, then top-k experts weighted by the softmax of their logits.

    The checkpoint holds the experts fused (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``). A shared MLP as wide as an expert (the decoder layer's
    ``shared_mlp``) is computed by the expert kernels as one more expert every token takes at weight 1.
    """

    def __init__(self, hf_config: Any, fuse_shared: bool):
        super().__init__()
        num_experts = hf_config.num_local_experts
        self.router = Linear(hf_config.hidden_size, num_experts)
        routing = Routing.top_k_softmax(num_experts, hf_config.num_experts_per_tok)
        self.experts = FusedExperts(num_experts, hf_config.hidden_size, hf_config.intermediate_size,
                                    hf_config.hidden_act, num_shared_experts=int(fuse_shared), routing=routing)

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states), ctx)  # [num_tokens, hidden]


class GraniteDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + m * attn(norm(x))``, ``out = h + m * mlp(norm(h))`` (m folded in)."""

    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding | None,
                 sliding_window: int | None, moe: bool):
        super().__init__()
        hidden = hf_config.hidden_size
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.self_attn = RopeSelfAttention(
            hidden, hf_config.num_attention_heads, num_kv_heads_of(hf_config), head_dim_of(hf_config), layer_idx,
            rotary_emb, qkv_bias=bias, o_bias=bias, scale=float(hf_config.attention_multiplier),
            sliding_window=sliding_window, has_sinks=True)
        self.input_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.residual_multiplier = float(hf_config.residual_multiplier)
        self.block_sparse_moe = self.mlp = self.shared_mlp = None
        if not moe:
            self.mlp = GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act,
                                bias=bool(getattr(hf_config, "mlp_bias", False)))
            return
        shared_size = getattr(hf_config, "shared_intermediate_size", 0) or 0
        self.fuse_shared = shared_size == hf_config.intermediate_size
        self.block_sparse_moe = SparseMoeBlock(hf_config, self.fuse_shared)
        if shared_size:
            self.shared_mlp = SharedMLP(hidden, shared_size, hf_config.hidden_act)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        scale = self.residual_multiplier
        branch_outputs = [self.self_attn.o_proj]
        if self.mlp is not None:
            branch_outputs.append(self.mlp.down_proj)
        else:
            self.block_sparse_moe.experts.down_proj.mul_(scale)
            if self.shared_mlp is not None:
                branch_outputs.append(self.shared_mlp.output_linear)
        for linear in branch_outputs:
            linear.weight.mul_(scale)
            if linear.bias is not None:
                linear.bias.mul_(scale)
        if self.shared_mlp is not None and self.fuse_shared:
            shared = self.shared_mlp
            self.block_sparse_moe.experts.load_shared_expert(0, shared.input_linear.weight, shared.output_linear.weight)
            self.shared_mlp = None  # its weights live in the experts now

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        if self.mlp is not None:
            return self.mlp(hidden_states), residual
        out = self.block_sparse_moe(hidden_states, ctx)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(hidden_states)
        return out, residual


class GraniteSWAModel(nn.Module):
    def __init__(self, config: ModelConfig, moe: bool):
        super().__init__()
        hf_config = config.hf_config
        self.embedding_multiplier = float(hf_config.embedding_multiplier)
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.rotary_embs, rotary_of_layer = rotary_per_layer(hf_config, head_dim_of(hf_config), config.max_model_len)
        windows = sliding_windows_of(hf_config, config.max_model_len)
        self.layers = nn.ModuleList(
            GraniteDecoderLayer(hf_config, layer_idx,
                                None if rotary_of_layer[layer_idx] is None else self.rotary_embs[rotary_of_layer[layer_idx]],
                                windows[layer_idx], moe)
            for layer_idx in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.embedding_multiplier != 1.0:
            hidden_states = hidden_states * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GraniteSWAForCausalLM(nn.Module):
    """The Weir model contract (``weir.model_interface``) for Granite SWA checkpoints."""

    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    ignored_checkpoint_patterns = (r"rotary_embs?\.", )
    moe = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        self.model = GraniteSWAModel(config, self.moe)
        tied = self.model.embed_tokens if getattr(hf_config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf_config.hidden_size, hf_config.vocab_size, tie_to=tied)
        self.logits_scaling = float(hf_config.logits_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # [num_tokens, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)  # [num_rows, vocab]
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def attention_layers(self) -> list[AttentionLayerSpec]:
        return [layer.self_attn.attn.spec for layer in self.model.layers]


class GraniteMoeSWAForCausalLM(GraniteSWAForCausalLM):
    """GraniteMoe SWA: every layer's MLP is a top-k-softmax MoE, plus a shared MLP when
    ``shared_intermediate_size`` > 0."""

    moe = True
