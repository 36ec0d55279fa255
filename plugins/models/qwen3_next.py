"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet layers and gated full attention, with
a softmax-routed MoE (plus a sigmoid-gated shared expert) after every mixer.

transformers' ``modeling_qwen3_next`` is the reference (tests/test_qwen3_next.py). Every plain
norm is the zero-centred ``(1 + w)`` flavour; only the DeltaNet output norm is a gated
plain-weight norm.
Fused checkpoint layouts are rearranged once after loading, so the forward needs no per-step
reshuffles: the gated-attention q projection (per head ``[q | gate]``) becomes ``[q... | gate...]``
and the DeltaNet input projections (grouped by key head) become ``[q | k | v | z | b | a]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weir.attention import AttentionLayerSpec
from weir.layer_cache import ForwardContext
from weir.config import ModelConfig
from weir.layers import (QKV_GATE_UP_STACKED_PARAMS, Attention, GatedMLP, LMHead, Linear, MergedLinear,
                         QKVLinear, RotaryEmbedding, VocabEmbedding)
from weir.layers.gates import delta_net_gates
from weir.layers.moe import PER_EXPERT_PATTERNS, FusedExperts
from weir.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm
from weir.linear_attention import GatedDeltaNetLayerSpec
from weir.moe import Routing
from weir.spec_decode.draft_head import TargetSharedHead

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


def layer_types_of(hf_config: Any) -> list[str]:
    """Each layer's mixer: the config's ``layer_types``, or every ``full_attention_interval``-th full."""
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        interval = hf_config.full_attention_interval
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                       for i in range(hf_config.num_hidden_layers)]
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ValueError(f"Qwen3-Next layer_types {unknown} are not supported")
    return list(layer_types)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate and partial RoPE (``Qwen3NextAttention``)."""

    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = hf_config.head_dim
        bias = bool(getattr(hf_config, "attention_bias", False))
        # The q shard holds q and the gate: 2 * num_heads * head_dim rows.
        self.qkv_proj = QKVLinear(hf_config.hidden_size, 2 * self.num_heads, self.num_kv_heads, self.head_dim, bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hf_config.hidden_size, bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(AttentionLayerSpec(
            layer_idx=layer_idx, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, scale=self.head_dim ** -0.5))

    def process_weights_after_loading(self) -> None:
        # Checkpoint q rows are per head [q_h | gate_h]; make them [q_0..q_H | gate_0..gate_H].
        q_rows = self.qkv_proj.shard_slice("q")
        for tensor in (self.qkv_proj.weight, self.qkv_proj.bias):
            if tensor is None:
                continue
            q_part = tensor.data[q_rows]  # [2 * H * D, ...]
            trailing = q_part.shape[1:]
            regrouped = q_part.reshape(self.num_heads, 2, self.head_dim, *trailing).transpose(0, 1)
            q_part.copy_(regrouped.reshape(q_part.shape))  # reshape of the transposed view copies

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_dim = self.num_heads * self.head_dim
        q_and_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q_and_gate[:, :q_dim].view(num_tokens, self.num_heads, self.head_dim)
        gate = q_and_gate[:, q_dim:]  # [num_tokens, H * D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb.forward_with_norms(positions, q, k, self.q_norm, self.k_norm)
        attn_out = self.attn(q, k, v, ctx).reshape(num_tokens, q_dim)  # [num_tokens, H * D]
        return self.o_proj(attn_out * torch.sigmoid(gate))


class DepthwiseConvWeight(nn.Module):
    """Holds ``conv1d.weight [channels, 1, kernel]`` (the conv itself runs in the backend)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    """Projections and gates of a Gated DeltaNet layer; conv and delta rule run in the backend."""

    def __init__(self, hf_config: Any, layer_idx: int):
        super().__init__()
        self.spec = GatedDeltaNetLayerSpec(
            layer_idx=layer_idx, num_k_heads=hf_config.linear_num_key_heads,
            num_v_heads=hf_config.linear_num_value_heads, head_k_dim=hf_config.linear_key_head_dim,
            head_v_dim=hf_config.linear_value_head_dim, conv_kernel=hf_config.linear_conv_kernel_dim)
        spec = self.spec
        self.in_proj = MergedLinear(hf_config.hidden_size, {
            "qkvz": 2 * spec.key_dim + 2 * spec.value_dim, "ba": 2 * spec.num_v_heads})
        self.conv1d = DepthwiseConvWeight(spec.conv_dim, spec.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(spec.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(spec.num_v_heads))
        self.norm = GatedRMSNorm(spec.head_v_dim, hf_config.rms_norm_eps)
        self.out_proj = Linear(spec.value_dim, hf_config.hidden_size)

    def process_weights_after_loading(self) -> None:
        # Checkpoint rows are grouped by key head: per group [q | k | v (r heads) | z (r heads)]
        # and [b (r) | a (r)] with r = num_v_heads / num_k_heads. Regroup by kind, heads in order.
        spec = self.spec
        ratio = spec.num_v_heads // spec.num_k_heads
        weight = self.in_proj.weight.data
        hidden = weight.shape[1]
        qkvz = weight[self.in_proj.shard_slice("qkvz")]
        per_group = [spec.head_k_dim, spec.head_k_dim, ratio * spec.head_v_dim, ratio * spec.head_v_dim]
        parts = qkvz.view(spec.num_k_heads, sum(per_group), hidden).split(per_group, dim=1)
        qkvz.copy_(torch.cat([part.reshape(-1, hidden) for part in parts]))
        ba = weight[self.in_proj.shard_slice("ba")]
        parts = ba.view(spec.num_k_heads, 2 * ratio, hidden).split([ratio, ratio], dim=1)
        ba.copy_(torch.cat([part.reshape(-1, hidden) for part in parts]))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        spec = self.spec
        num_tokens = hidden_states.shape[0]
        projected = self.in_proj(hidden_states)  # [num_tokens, conv_dim + value_dim + 2 * HV]
        mixed_qkv, z, b, a = projected.split(
            [spec.conv_dim, spec.value_dim, spec.num_v_heads, spec.num_v_heads], dim=-1)
        g, beta = delta_net_gates(a, b, self.A_log, self.dt_bias)  # [num_tokens, HV] each
        layer = ctx.layers[spec.layer_idx]
        backend = layer.backend
        core_out = backend.forward(spec, mixed_qkv, g, beta, self.conv1d.weight.squeeze(1),
                                   layer.cache, layer.metadata)  # [num_tokens, HV, Dv]
        expected = (num_tokens, spec.num_v_heads, spec.head_v_dim)
        if tuple(core_out.shape) != expected or core_out.dtype != mixed_qkv.dtype:
            raise RuntimeError(f"linear-attention backend {backend.name!r} returned {core_out.dtype} "
                               f"{tuple(core_out.shape)}; expected {mixed_qkv.dtype} {expected} "
                               f"(tokens, value heads, value head dim)")
        gated = self.norm(core_out, z.view(num_tokens, spec.num_v_heads, spec.head_v_dim))
        return self.out_proj(gated.reshape(num_tokens, spec.value_dim))


class RouterLinear(MergedLinear):
    """The router's rows (shard ``routed``), the shared expert's gate row (``shared_gate``), then
    zero rows up to a multiple of 8. Without them the ``[T, E + 1]`` output has rows that are not
    16-byte aligned, which sent cuBLAS to an sm75 align-1 kernel taking 16.7 us per layer at 256
    tokens on the H200 (benchmarks/profile_steps.py; the padded GEMM was not timed on its own)."""

    def __init__(self, hidden_size: int, num_experts: int):
        padding = -(num_experts + 1) % 8
        super().__init__(hidden_size, {"routed": num_experts, "shared_gate": 1, "padding": padding})

    @property
    def shard_ids(self) -> tuple[str, ...]:
        return ("routed", "shared_gate")  # the padding rows come from no checkpoint tensor

    def process_weights_after_loading(self) -> None:
        self.weight.data[self.shard_slice("padding")] = 0

    def split(self, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., rows]`` -> (router logits ``[..., E]``, shared-gate logits ``[..., 1]``)."""
        return output[..., self.shard_slice("routed")], output[..., self.shard_slice("shared_gate")]


class SparseMoeBlock(nn.Module):
    """Softmax top-k experts plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

    The router and the shared expert's gate are one GEMM (``RouterLinear``). When the shared
    expert is as wide as a routed one (as in every released Qwen3-Next), it is copied after
    loading into the fused experts as one more expert that every token uses, weighted by its
    gate: the MoE kernels then compute it too, and the dense MLP, its gate GEMM, the sigmoid, the
    product and the final sum go away (559 instead of 703 kernels per decode step of the
    24-layer model; benchmarks/profile_steps.py on the H200).
    """

    def __init__(self, hf_config: Any):
        super().__init__()
        hidden = hf_config.hidden_size
        self.router = RouterLinear(hidden, hf_config.num_experts)
        self.fuse_shared = hf_config.shared_expert_intermediate_size == hf_config.moe_intermediate_size
        routing = Routing.softmax_top_k(hf_config.num_experts, hf_config.num_experts_per_tok,
                                        bool(hf_config.norm_topk_prob))
        self.experts = FusedExperts(hf_config.num_experts, hidden, hf_config.moe_intermediate_size,
                                    hf_config.hidden_act, num_shared_experts=int(self.fuse_shared), routing=routing)
        self.shared_expert = GatedMLP(hidden, hf_config.shared_expert_intermediate_size, hf_config.hidden_act)

    def process_weights_after_loading(self) -> None:
        if self.fuse_shared:
            self.experts.load_shared_expert(0, self.shared_expert.gate_up_proj.weight,
                                            self.shared_expert.down_proj.weight)
            self.shared_expert = None  # its weights live in the experts now

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        router_logits, shared_gate_logits = self.router.split(self.router(hidden_states))  # [T, E], [T, 1]
        if self.shared_expert is None:
            return self.experts(hidden_states, router_logits, ctx,
                                shared_gate_logits=shared_gate_logits)  # [num_tokens, hidden]
        routed = self.experts(hidden_states, router_logits, ctx)
        shared = torch.sigmoid(shared_gate_logits) * self.shared_expert(hidden_states)
        return routed + shared  # [num_tokens, hidden]


class DenseMLP(GatedMLP):
    """The plain gated MLP of layers listed in ``mlp_only_layers``."""

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return super().forward(hidden_states)


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm block: a Gated DeltaNet or gated-attention mixer, then the (sparse) MLP."""

    def __init__(self, hf_config: Any, layer_idx: int, layer_type: str, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden = hf_config.hidden_size
        self.is_linear = layer_type == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(hf_config, layer_idx)
        else:
            self.self_attn = GatedAttention(hf_config, layer_idx, rotary_emb)
        sparse_step = hf_config.decoder_sparse_step
        if not isinstance(sparse_step, int) or sparse_step < 1:
            raise ValueError(f"decoder_sparse_step in the config must be an integer >= 1 (every how "
                             f"many layers one has experts), got {sparse_step!r}")
        is_sparse = (layer_idx not in (hf_config.mlp_only_layers or []) and hf_config.num_experts > 0
                     and (layer_idx + 1) % sparse_step == 0)
        self.mlp = (SparseMoeBlock(hf_config) if is_sparse
                    else DenseMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act))
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, hf_config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, hf_config.rms_norm_eps)

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
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden_states = mixer(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states, ctx), residual


class Qwen3NextModel(nn.Module):
    """Embedding, the decoder layers (one shared partial-RoPE cache) and the final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.rotary_emb = RotaryEmbedding(hf_config, hf_config.head_dim, config.max_model_len)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(hf_config, layer_idx, layer_type, self.rotary_emb)
            for layer_idx, layer_type in enumerate(layer_types_of(hf_config)))
        self.norm = ZeroCenteredRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3NextMTP(TargetSharedHead):
    """Qwen3-Next's multi-token-prediction block as a draft head (``speculative_config`` method
    ``mtp``, in the layout vLLM's ``qwen3_next_mtp`` loads). Its weights are the target
    checkpoint's ``mtp.*``; the embedding and the LM head are the target's own (``bind_target``).
    A pass at position ``p`` takes the token at ``p + 1`` and a hidden state of ``p`` (the
    target's final one, post-norm, then its own output)::

        x = mtp.fc(cat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
        x = mtp.layers[step % num_layers](x)   # gated full attention + MoE, its own KV cache
        out = mtp.norm(x)                      # the logits' input, and the next pass's hidden

    The layers' attention takes layer indices after the target's (``num_hidden_layers + i``).
    """

    stacked_params = QKV_GATE_UP_STACKED_PARAMS + (
        ("router", "gate", "routed"),
        ("router", "shared_expert_gate", "shared_gate"),
    )
    stacked_param_patterns = PER_EXPERT_PATTERNS
    ignored_checkpoint_patterns = (r"rotary_emb\.inv_freq$",)

    @staticmethod
    def checkpoint_pattern(hf_config) -> str:
        """The checkpoint names this head loads (a regular expression)."""
        return r"mtp\."

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        hidden = hf_config.hidden_size
        num_layers = int(getattr(hf_config, "mtp_num_hidden_layers", None)
                         or getattr(hf_config, "num_nextn_predict_layers", None) or 1)
        self.rotary_emb = RotaryEmbedding(hf_config, hf_config.head_dim, config.max_model_len)
        self.mtp = nn.Module()
        self.mtp.fc = Linear(2 * hidden, hidden)
        self.mtp.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, hf_config.rms_norm_eps)
        self.mtp.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, hf_config.rms_norm_eps)
        self.mtp.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(hf_config, hf_config.num_hidden_layers + i, FULL_ATTENTION, self.rotary_emb)
            for i in range(num_layers))
        self.mtp.norm = ZeroCenteredRMSNorm(hidden, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        embed_tokens = self.embedding()
        embeds = self.mtp.pre_fc_norm_embedding(embed_tokens(input_ids))  # [num_tokens, hidden]
        x = self.mtp.fc(torch.cat([embeds, self.mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = self.mtp.layers[step % len(self.mtp.layers)]
        x, residual = layer(positions, x, None, ctx)
        out, _ = self.mtp.norm(x, residual)
        return out, out

    def attention_layers(self) -> list[AttentionLayerSpec]:
        return [layer.self_attn.attn.spec for layer in self.mtp.layers]


class Qwen3NextForCausalLM(nn.Module):
    """The Weir model contract (``weir.model_interface``) for Qwen3-Next checkpoints.

    The ``mtp.*`` weights are skipped here (as transformers skips them); speculative decoding's
    ``mtp`` method loads them into ``Qwen3NextMTP``, its ``mtp_head_class``.
    """

    stacked_params = QKV_GATE_UP_STACKED_PARAMS + (
        ("in_proj", "in_proj_qkvz", "qkvz"),
        ("in_proj", "in_proj_ba", "ba"),
        ("router", "gate", "routed"),  # mlp.gate.weight: whole dotted parts, so not gate_proj
        ("router", "shared_expert_gate", "shared_gate"),
    )
    stacked_param_patterns = PER_EXPERT_PATTERNS
    ignored_checkpoint_patterns = (r"rotary_emb\.inv_freq$", r"^mtp\.")
    mtp_head_class = Qwen3NextMTP

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        self.model = Qwen3NextModel(config)
        tied = self.model.embed_tokens if getattr(hf_config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf_config.hidden_size, hf_config.vocab_size, tie_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # [num_tokens, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [num_rows, vocab]

    def attention_layers(self) -> list[AttentionLayerSpec]:
        return [layer.self_attn.attn.spec for layer in self.model.layers if hasattr(layer, "self_attn")]

    def state_layers(self) -> list[GatedDeltaNetLayerSpec]:
        return [layer.linear_attn.spec for layer in self.model.layers if hasattr(layer, "linear_attn")]
