"""Kimi Linear (``KimiLinearForCausalLM``): Kimi Delta Attention layers and MLA layers without
RoPE, mixed as ``linear_attn_config`` lists them, each followed by a dense MLP (the first
``first_k_dense_replace`` layers) or a DeepSeek-style sigmoid-routed MoE with shared experts.

transformers' ``modeling_kimi_linear`` is the reference (tests/test_kimi_linear.py). The MLA
layers are DeepSeek-V3's (``deepseek_v3.MLAAttention`` without a rotary embedding: the rope part
of the key is cached and used unrotated, the softmax scale is ``(qk_nope + qk_rope) ** -0.5``);
the MoE is DeepSeek-V3's with Kimi's checkpoint names (``block_sparse_moe.experts.E.{w1,w3,w2}``:
gate, up, down). A KDA layer's projections from the hidden state (q, k, v, the low-rank ``a``
halves of the forget and output gates, beta) run as one GEMM; its three short convs are one
depthwise conv over the q|k|v channels, run with the delta rule by the KDA backend
(``weir.linear_attention.KimiDeltaAttentionBackend``) over the request's state slot.

Checkpoints use the remote-code config names (``num_experts``, ``moe_renormalize``, ...), which
transformers' ``KimiLinearConfig`` maps. Refused by name rather than served differently: the
gate variants of newer Kimi models (a lower-bounded "safe" gate, gates computed in the kernel,
full-rank gates), for which transformers has no Kimi Linear reference, MLA with RoPE
(``mla_use_nope: false``), and router or MoE-placement settings transformers does not implement.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from weir.config import ModelConfig
from weir.layer_cache import ForwardContext
from weir.layers import GatedMLP, LMHead, Linear, MergedLinear, RMSNorm, VocabEmbedding
from weir.layers.gates import kimi_delta_gate
from weir.layers.moe import FusedExperts
from weir.layers.norm import SigmoidGatedRMSNorm
from weir.linear_attention import KimiDeltaAttentionLayerSpec
from weir.mla import MLALayerSpec
from weir.plugins.models.deepseek_v3 import (STACKED_PARAMS, DeepseekMoE, MLAAttention, ignored_checkpoint_patterns,
                                             is_moe_layer, num_mtp_layers)

logger = logging.getLogger(__name__)

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
LINEAR_ATTN_CONFIG_KEYS = frozenset({"kda_layers", "full_attn_layers", "num_heads", "head_dim",
                                     "short_conv_kernel_size"})
# Gate variants of newer Kimi models (and of GLM-5.3's KDA, whose config names these are):
# transformers' Kimi Linear ignores them, so there is no reference to serve them against.
# ``linear_lower_bound`` is the top-level name transformers' GLM-5-Next config saves the bound under.
GATE_VARIANT_KEYS = ("gate_lower_bound", "safe_gate", "lower_bound", "linear_lower_bound", "use_gate_in_kernel",
                     "use_full_rank_gate")

STACKED_KIMI_PARAMS = STACKED_PARAMS + (
    # A KDA layer's projections of the hidden state: one GEMM, in the name MLA's fused input
    # projection has (its q_proj shard is the same checkpoint name in both kinds of layer).
    ("fused_qkv_a_proj", "k_proj", "k"),
    ("fused_qkv_a_proj", "v_proj", "v"),
    ("fused_qkv_a_proj", "f_a_proj", "f_a"),
    ("fused_qkv_a_proj", "g_a_proj", "g_a"),
    ("fused_qkv_a_proj", "b_proj", "b"),
    ("conv1d", "q_conv1d", "q"),
    ("conv1d", "k_conv1d", "k"),
    ("conv1d", "v_conv1d", "v"),
)
KIMI_EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
KIMI_PARAM_PATTERNS = (
    (r"\.experts\.(\d+)\.w1\.weight$", ".experts.gate_up_proj", r"gate.\1"),
    (r"\.experts\.(\d+)\.w3\.weight$", ".experts.gate_up_proj", r"up.\1"),
    (r"\.experts\.(\d+)\.w2\.weight$", ".experts.down_proj", r"down.\1"),
    # transformers saves the dense MLP of the first layers under block_sparse_moe too (it renames
    # block_sparse_moe to mlp when loading, and back when saving); the released checkpoints say mlp.
    (r"\.block_sparse_moe\.(gate|up)_proj\.weight$", r".mlp.gate_up_proj.weight", r"\1"),
    (r"\.block_sparse_moe\.down_proj\.weight$", ".mlp.down_proj.weight", "down"),
)


def _layer_list(linear_attn_config: dict, key: str, num_layers: int) -> list[int]:
    """A 1-indexed layer list of ``linear_attn_config``, checked, as 0-indexed layer numbers."""
    layers = linear_attn_config.get(key)
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"linear_attn_config.{key} must be a list of layer numbers (1-indexed), got {layers!r}")
    outside = sorted(i for i in layers if not 1 <= i <= num_layers)
    if outside:
        raise ValueError(f"linear_attn_config.{key} lists layers {outside}, outside 1..{num_layers} (the layers "
                         f"are numbered from 1 there)")
    return [i - 1 for i in layers]


def layer_types_of(hf_config: Any) -> list[str]:
    """Each layer's mixer: from ``linear_attn_config``'s 1-indexed ``kda_layers`` and
    ``full_attn_layers`` (the released checkpoints' way), else the config's ``layer_types``."""
    num_layers = hf_config.num_hidden_layers
    declared = getattr(hf_config, "layer_types", None)
    linear_attn_config = getattr(hf_config, "linear_attn_config", None)
    if linear_attn_config is not None and not isinstance(linear_attn_config, dict):
        raise ValueError(f"linear_attn_config must be a JSON object, got {linear_attn_config!r}")
    if linear_attn_config and ("kda_layers" in linear_attn_config or "full_attn_layers" in linear_attn_config):
        kda = _layer_list(linear_attn_config, "kda_layers", num_layers)
        full = _layer_list(linear_attn_config, "full_attn_layers", num_layers)
        both = sorted(set(kda) & set(full))
        neither = sorted(set(range(num_layers)) - set(kda) - set(full))
        if both or neither or len(kda) + len(full) != num_layers:
            raise ValueError(f"linear_attn_config must list each of the {num_layers} layers once, in kda_layers or "
                             f"full_attn_layers (1-indexed); layers {[i + 1 for i in both]} are in both, "
                             f"{[i + 1 for i in neither]} in neither, or one is listed twice")
        types = [FULL_ATTENTION if i in full else LINEAR_ATTENTION for i in range(num_layers)]
        if declared and list(declared) != types:
            raise ValueError(f"the config's layer_types {list(declared)} disagree with linear_attn_config's "
                             f"kda_layers / full_attn_layers {types}")
        return types
    if not declared:
        raise ValueError("a Kimi Linear config must say which layers are KDA and which MLA: linear_attn_config's "
                         "kda_layers and full_attn_layers (1-indexed), or layer_types")
    unknown = sorted(set(declared) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown or len(declared) != num_layers:
        raise ValueError(f"layer_types must hold 'full_attention' or 'linear_attention' for each of the {num_layers} "
                         f"layers, got {list(declared)!r}")
    return list(declared)


def check_supported(hf_config: Any) -> None:
    """Refuse, by name, the settings Weir's Kimi Linear would otherwise serve differently from
    transformers (which ignores them) or from the model they were trained with."""
    linear_attn_config = getattr(hf_config, "linear_attn_config", None) or {}
    for key in GATE_VARIANT_KEYS:
        # Either place may ask for it; a bound of 0 is a bound (``0 == False`` must not hide it).
        for value in (linear_attn_config.get(key), getattr(hf_config, key, None)):
            if value is not None and value is not False:
                raise ValueError(f"{key}={value!r} asks for a KDA gate variant of newer Kimi models (a lower-bounded "
                                 f"'safe' gate, gates computed in the kernel, full-rank gates); transformers' Kimi "
                                 f"Linear has no reference for it, so Weir does not serve it")
    unknown = sorted(set(linear_attn_config) - LINEAR_ATTN_CONFIG_KEYS - set(GATE_VARIANT_KEYS))
    if unknown:
        raise ValueError(f"linear_attn_config has keys {unknown} that Weir's Kimi Linear does not know; it reads "
                         f"{sorted(LINEAR_ATTN_CONFIG_KEYS)}")
    if getattr(hf_config, "mla_use_nope", True) is not True:
        raise ValueError("mla_use_nope=false (RoPE on the MLA layers) is not Kimi Linear as transformers implements "
                         "it (MLA without RoPE); Weir does not serve it")
    activation = getattr(hf_config, "moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ValueError(f"moe_router_activation_func={activation!r} is not supported: Kimi Linear routes with "
                         f"sigmoid scores")
    moe_layer_freq = getattr(hf_config, "moe_layer_freq", None) or 1
    if moe_layer_freq != 1:
        raise ValueError(f"moe_layer_freq={moe_layer_freq} is not supported: every Kimi Linear layer past "
                         f"first_k_dense_replace is MoE (moe_layer_freq 1)")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: Kimi Delta Attention's short convs are followed by "
                         f"SiLU in Weir's KDA backends, and transformers uses hidden_act there; only 'silu' is served")


class StackedConvWeight(nn.Module):
    """``weight [3 * H * K, 1, kernel]``: the q, k and v depthwise convs (checkpoint
    ``{q,k,v}_conv1d.weight``, shards ``q``, ``k``, ``v``) as one conv over the q|k|v channels."""

    def __init__(self, channels_per_part: int, kernel: int):
        super().__init__()
        self.channels_per_part = channels_per_part
        self.weight = nn.Parameter(torch.empty(3 * channels_per_part, 1, kernel))

    @property
    def shard_ids(self) -> tuple[str, ...]:
        return ("q", "k", "v")

    def shard_slice(self, shard_id: str) -> slice:
        index = self.shard_ids.index(shard_id)
        return slice(index * self.channels_per_part, (index + 1) * self.channels_per_part)


class KimiDeltaAttention(nn.Module):
    """Projections, gates and output norm of a KDA layer (``KimiLinearDeltaAttention``); the convs
    and the delta rule run in the backend."""

    keep_fp32_params = ("dt_bias",)  # as transformers keeps it (_keep_in_fp32_modules_strict)

    def __init__(self, hf_config: Any, layer_idx: int):
        super().__init__()
        num_heads, head_dim = hf_config.linear_num_heads, hf_config.linear_head_dim
        self.spec = KimiDeltaAttentionLayerSpec(layer_idx=layer_idx, num_heads=num_heads, head_dim=head_dim,
                                                conv_kernel=hf_config.linear_conv_kernel_dim)
        key_dim = self.spec.key_dim
        hidden = hf_config.hidden_size
        self.fused_qkv_a_proj = MergedLinear(hidden, {"q": key_dim, "k": key_dim, "v": key_dim,
                                                      "f_a": head_dim, "g_a": head_dim, "b": num_heads})
        self.conv1d = StackedConvWeight(key_dim, self.spec.conv_kernel)
        self.f_b_proj = Linear(head_dim, key_dim)
        self.g_b_proj = Linear(head_dim, key_dim)
        self.dt_bias = nn.Parameter(torch.empty(key_dim))
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1))  # the checkpoint's shape
        self.o_norm = SigmoidGatedRMSNorm(head_dim, hf_config.rms_norm_eps)
        self.o_proj = Linear(key_dim, hidden)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        spec = self.spec
        num_tokens = hidden_states.shape[0]
        projected = self.fused_qkv_a_proj(hidden_states)  # [num_tokens, 3HK + 2K + H]
        mixed_qkv, f_a, g_a, b = projected.split([spec.conv_dim, spec.head_dim, spec.head_dim, spec.num_heads],
                                                 dim=-1)
        g = kimi_delta_gate(self.f_b_proj(f_a), self.A_log, self.dt_bias, spec.num_heads)  # [T, H, K] fp32
        beta = b.sigmoid()  # [num_tokens, H]
        layer = ctx.layers[spec.layer_idx]
        backend = layer.backend
        core_out = backend.forward(spec, mixed_qkv, g, beta, self.conv1d.weight.squeeze(1), layer.cache,
                                   layer.metadata)  # [num_tokens, H, K]
        expected = (num_tokens, spec.num_heads, spec.head_dim)
        if tuple(core_out.shape) != expected or core_out.dtype != hidden_states.dtype:
            raise RuntimeError(f"Kimi Delta Attention backend {backend.name!r} returned {core_out.dtype} "
                               f"{tuple(core_out.shape)}; expected {hidden_states.dtype} {expected} "
                               f"(tokens, heads, head dim)")
        gate = self.g_b_proj(g_a).view(expected)  # [num_tokens, H, K]
        return self.o_proj(self.o_norm(core_out, gate).reshape(num_tokens, spec.key_dim))


class KimiExperts(FusedExperts):
    """``FusedExperts`` with Kimi's per-expert checkpoint names (``E.w1`` gate, ``E.w3`` up, ``E.w2`` down)."""

    def checkpoint_suffix(self, shard_id: str) -> str:
        kind, _, expert = shard_id.partition(".")
        return f"{expert}.{KIMI_EXPERT_NAMES[kind]}.weight"


class KimiMoE(DeepseekMoE):
    """DeepSeek-V3's MoE (fp32 router, grouped sigmoid top-k with the correction bias, shared
    experts among the fused ones) with Kimi's config and checkpoint names."""

    experts_cls = KimiExperts

    @staticmethod
    def num_routed_experts(hf_config: Any) -> int:
        return hf_config.num_local_experts  # the checkpoint's num_experts


class DenseMLP(GatedMLP):
    """The plain gated MLP of the first layers. ``down_proj`` holds one shard (``down``) so that
    transformers' saved name for it (under ``block_sparse_moe``) can map onto it too."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__(hidden_size, intermediate_size, hidden_act)
        self.down_proj = MergedLinear(intermediate_size, {"down": hidden_size})

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return super().forward(hidden_states)


class KimiDecoderLayer(nn.Module):
    """Pre-norm block: KDA or MLA, then the dense MLP (``mlp``) or the MoE (``block_sparse_moe``)."""

    def __init__(self, hf_config: Any, layer_idx: int, layer_type: str):
        super().__init__()
        hidden = hf_config.hidden_size
        self.self_attn = (MLAAttention(hf_config, layer_idx, rotary_emb=None) if layer_type == FULL_ATTENTION
                          else KimiDeltaAttention(hf_config, layer_idx))
        # transformers' mlp_layer_types, derived from first_k_dense_replace unless the config lists them.
        self.feed_forward_name = "block_sparse_moe" if is_moe_layer(hf_config, layer_idx) else "mlp"
        if self.feed_forward_name == "mlp":
            self.mlp = DenseMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act)
        else:
            self.block_sparse_moe = KimiMoE(hf_config)
        self.input_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)

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
        return getattr(self, self.feed_forward_name)(hidden_states, ctx), residual


class KimiLinearForCausalLM(nn.Module):
    """The Weir model contract (``weir.model_interface``) for Kimi Linear checkpoints.

    MTP layers the config declares (``num_nextn_predict_layers``, none in the released
    checkpoints) are skipped, as for DeepSeek-V3; any other layer past the last is refused.
    """

    stacked_params = STACKED_KIMI_PARAMS
    stacked_param_patterns = KIMI_PARAM_PATTERNS

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        check_supported(hf_config)
        num_layers = hf_config.num_hidden_layers
        self.ignored_checkpoint_patterns = ignored_checkpoint_patterns(hf_config)
        num_mtp = num_mtp_layers(hf_config)
        if num_mtp:
            logger.info("%s: the checkpoint's %d MTP layer(s) (model.layers.%d.* on) are not loaded",
                        type(self).__name__, num_mtp, num_layers)
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.model.layers = nn.ModuleList(KimiDecoderLayer(hf_config, layer_idx, layer_type)
                                          for layer_idx, layer_type in enumerate(layer_types_of(hf_config)))
        self.model.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        tied = self.model.embed_tokens if getattr(hf_config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf_config.hidden_size, hf_config.vocab_size, tie_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden_states = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.model.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        hidden_states, _ = self.model.norm(hidden_states, residual)
        return hidden_states  # [num_tokens, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [num_rows, vocab]

    def attention_layers(self) -> list[MLALayerSpec]:
        return [layer.self_attn.spec for layer in self.model.layers if isinstance(layer.self_attn, MLAAttention)]

    def state_layers(self) -> list[KimiDeltaAttentionLayerSpec]:
        return [layer.self_attn.spec for layer in self.model.layers
                if isinstance(layer.self_attn, KimiDeltaAttention)]
