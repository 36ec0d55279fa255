"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, also Kimi-K2-style text models): multi-head latent
attention over a paged latent cache, and a sigmoid-routed, group-limited MoE with shared experts
after the first ``first_k_dense_replace`` dense layers.

transformers' ``modeling_deepseek_v3`` is the reference (tests/test_deepseek.py); the maths is in
``weir.mla`` and the project's model notes. Per layer the model computes the projections, the
latent norm and RoPE (interleaved pairs on the last ``qk_rope_head_dim`` dims, with YaRN's mscale
squared in the softmax scale); the MLA backend stores ``[kv_c | k_pe]`` and attends, given the two
halves of ``kv_b_proj`` as ``w_uk`` / ``w_uv`` (views made once after loading).

The router weight and ``e_score_correction_bias`` stay float32 whatever the model dtype
(``keep_fp32_params``), as transformers keeps them. Shared experts are computed by the MoE kernels
as extra experts every token takes at weight 1 (``routed_scaling_factor`` scales the routed
experts only, as in transformers). The checkpoint's MTP layers (``model.layers.N.*`` for N >=
``num_hidden_layers``) are skipped until speculative decoding uses them.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from weir.config import ModelConfig
from weir.layer_cache import ForwardContext
from weir.layers import Fp32Linear, GatedMLP, LMHead, Linear, MergedLinear, RMSNorm, RotaryEmbedding, VocabEmbedding
from weir.layers.moe import PER_EXPERT_PATTERNS, FusedExperts
from weir.layers.rotary import InterleavedRotaryEmbedding, rope_parameters_of
from weir.mla import IndexerInputs, MLALayerSpec, SelectedKeys
from weir.moe import Routing
from weir.spec_decode.draft_head import TargetSharedHead

logger = logging.getLogger(__name__)

# transformers builds q_a_layernorm and kv_a_layernorm with their default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6

STACKED_PARAMS = (
    ("fused_qkv_a_proj", "q_a_proj", "q_a"),
    ("fused_qkv_a_proj", "q_proj", "q"),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv_a"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(hf_config: Any) -> float:
    """``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled
    RoPE with a non-zero ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters_of(hf_config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ValueError(f"rope_parameters sets mscale_all_dim={mscale_all_dim} but no numeric factor "
                             f"(got {factor!r}): the softmax scale needs both")
        scale *= yarn_mscale(float(factor), float(mscale_all_dim)) ** 2
    return scale


def mla_rotary(hf_config: Any, max_positions: int, interleaved: bool) -> RotaryEmbedding:
    """The rotary embedding of the ``qk_rope_head_dim`` rope dims (interleaved pairs or rotate_half)."""
    rope_dim = hf_config.qk_rope_head_dim
    rotary_cls = InterleavedRotaryEmbedding if interleaved else RotaryEmbedding
    return rotary_cls(hf_config, rope_dim, max_positions, rotary_dim=rope_dim)


class LatentInputProj(MergedLinear):
    """The projections of the hidden state MLA runs as one GEMM: the q latent (``q_a_proj``; the
    full query ``q_proj`` when ``q_lora_rank`` is None) and ``kv_a_proj_with_mqa`` (the kv latent
    and the shared rope key). transformers gives ``q_proj`` no bias even with ``attention_bias``:
    those bias rows then come from no checkpoint tensor and stay zero."""

    def __init__(self, hidden_size: int, q_shard: str, q_size: int, kv_a_size: int, bias: bool):
        super().__init__(hidden_size, {q_shard: q_size, "kv_a": kv_a_size}, bias)
        self.q_shard = q_shard
        self.q_has_bias = bias and q_shard == "q_a"

    def param_shard_ids(self, attr: str) -> tuple[str, ...]:
        if attr == "bias" and not self.q_has_bias:
            return ("kv_a",)
        return self.shard_ids

    def process_weights_after_loading(self) -> None:
        if self.bias is not None and not self.q_has_bias:
            self.bias.data[self.shard_slice(self.q_shard)] = 0


class MLAAttention(nn.Module):
    """Projections, latent norm and RoPE of one MLA layer (``DeepseekV3Attention``); the backend
    stores the latent and attends. A sparse layer's ``indexer`` (DeepSeek-V3.2) turns the hidden
    state and the q latent into ``IndexerInputs``.

    ``rotary_emb=None`` is MLA without RoPE (Kimi Linear's ``mla_use_nope``): the rope part of q
    and the shared rope key are cached and used unrotated, and the softmax scale is the plain
    ``(qk_nope + qk_rope) ** -0.5`` (no YaRN mscale)."""

    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding | None,
                 indexer: nn.Module | None = None, shares_topk: bool = False):
        super().__init__()
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.q_lora_rank = hf_config.q_lora_rank
        self.kv_lora_rank = hf_config.kv_lora_rank
        self.qk_nope_head_dim = hf_config.qk_nope_head_dim
        self.qk_rope_head_dim = hf_config.qk_rope_head_dim
        self.v_head_dim = hf_config.v_head_dim
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(hf_config, "attention_bias", False))
        kv_a_size = self.kv_lora_rank + self.qk_rope_head_dim
        if self.q_lora_rank:
            self.fused_qkv_a_proj = LatentInputProj(hidden, "q_a", self.q_lora_rank, kv_a_size, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk_head_dim)
        else:
            self.fused_qkv_a_proj = LatentInputProj(hidden, "q", self.num_heads * qk_head_dim, kv_a_size, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias)
        self.rotary_emb = rotary_emb
        self.indexer = indexer
        index_fields = {}
        if shares_topk:  # sparse without an indexer: the keys the last layer with one picked
            index_fields = dict(index_topk=hf_config.index_topk, shares_topk=True)
        elif indexer is not None:
            if not self.q_lora_rank:
                raise ValueError("sparse (DSA) MLA layers need q_lora_rank: the indexer reads the q latent")
            index_fields = dict(index_n_heads=indexer.num_heads, index_head_dim=indexer.head_dim,
                                index_topk=indexer.index_topk)
        self.spec = MLALayerSpec(
            layer_idx=layer_idx, num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            scale=mla_softmax_scale(hf_config) if rotary_emb is not None else qk_head_dim ** -0.5, **index_fields)
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        # Views, not copies: per head, kv_b_proj's rows are [k_nope (qk_nope) | v (v_head_dim)].
        per_head = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                              self.kv_lora_rank)
        self.w_uk = per_head[:, : self.qk_nope_head_dim]  # [H, qk_nope, kv_lora_rank]
        self.w_uv = per_head[:, self.qk_nope_head_dim:]  # [H, v_head_dim, kv_lora_rank]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext,
                selected: SelectedKeys | None = None) -> torch.Tensor:
        """``selected``: the forward's shared top-k, for models with layers that share one."""
        num_tokens = hidden_states.shape[0]
        q_part, kv_a = self.fused_qkv_a_proj.split(self.fused_qkv_a_proj(hidden_states))
        q_latent = None
        if self.q_lora_rank:
            q_latent = self.q_a_layernorm(q_part)  # [num_tokens, q_lora_rank]
            q = self.q_b_proj(q_latent)
        else:
            q = q_part
        q = q.view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [num_tokens, kv_lora_rank]
        if self.rotary_emb is not None:
            q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
            k_pe = k_pe.squeeze(1)
        indexer_inputs: IndexerInputs | None = None
        if self.indexer is not None:
            indexer_inputs = self.indexer(positions, hidden_states, q_latent)
        layer = ctx.layers[self.spec.layer_idx]
        # Only models with shared top-k layers hand ``selected`` on: backends written before it
        # existed keep serving every other model.
        shared = {} if selected is None else {"selected": selected}
        attn_out = layer.backend.forward(self.spec, q_nope, q_pe, kv_c, k_pe, layer.cache, layer.metadata,
                                         self.w_uk, self.w_uv, indexer=indexer_inputs,
                                         **shared)  # [num_tokens, H, v_head_dim]
        expected = (num_tokens, self.num_heads, self.v_head_dim)
        if tuple(attn_out.shape) != expected or attn_out.dtype != hidden_states.dtype:
            raise RuntimeError(f"MLA backend {layer.backend.name!r} returned {attn_out.dtype} "
                               f"{tuple(attn_out.shape)}; expected {hidden_states.dtype} {expected}")
        return self.o_proj(attn_out.reshape(num_tokens, self.num_heads * self.v_head_dim))


class Router(Fp32Linear):
    """``gate.weight [E, hidden]`` and ``gate.e_score_correction_bias [E]``, both kept float32;
    the logits ``[num_tokens, E]`` are fp32 as in ``DeepseekV3TopkRouter`` (for bf16 inputs on
    CUDA from the weight's bf16 halves, to about 2**-16: experts that nearly tie may then be
    chosen otherwise than by transformers' fp32 GEMM)."""

    keep_fp32_params = Fp32Linear.keep_fp32_params + ("e_score_correction_bias",)

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__(hidden_size, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))


class DeepseekMoE(nn.Module):
    """Sigmoid scores plus the correction bias choose the top-k within the best expert groups;
    ``n_shared_experts`` shared experts (one MLP of ``n_shared_experts * moe_intermediate_size``
    in the checkpoint) are split after loading into that many experts of the routed width, which
    every token takes at weight 1: the MoE kernels compute them with the routed ones.

    Subclasses of other families (Kimi Linear) say where their config counts the routed experts
    (``num_routed_experts``) and how their checkpoint names them (``experts_cls``)."""

    experts_cls: type[FusedExperts] = FusedExperts

    @staticmethod
    def num_routed_experts(hf_config: Any) -> int:
        return hf_config.n_routed_experts

    def __init__(self, hf_config: Any):
        super().__init__()
        # Fields of the original DeepSeek configs that transformers reads as fixed: refuse others
        # rather than route another way than the checkpoint was trained with.
        scoring, topk_method = getattr(hf_config, "scoring_func", "sigmoid"), getattr(hf_config, "topk_method", None)
        if scoring != "sigmoid" or topk_method not in (None, "noaux_tc"):
            raise ValueError(f"DeepSeek-V3 MoE routing is sigmoid scoring with noaux_tc top-k; this config asks for "
                             f"scoring_func={scoring!r}, topk_method={topk_method!r}")
        hidden = hf_config.hidden_size
        num_experts = self.num_routed_experts(hf_config)
        self.intermediate_size = hf_config.moe_intermediate_size
        self.num_shared = int(hf_config.n_shared_experts or 0)
        self.gate = Router(hidden, num_experts)
        routing = Routing.sigmoid_grouped_top_k(
            num_experts, hf_config.num_experts_per_tok, num_groups=hf_config.n_group or 1,
            top_k_groups=hf_config.topk_group or 1, renormalize=bool(hf_config.norm_topk_prob),
            routed_scaling_factor=hf_config.routed_scaling_factor)
        self.experts = self.experts_cls(num_experts, hidden, self.intermediate_size, hf_config.hidden_act,
                                        num_shared_experts=self.num_shared, routing=routing)
        self.shared_experts = (GatedMLP(hidden, self.num_shared * self.intermediate_size, hf_config.hidden_act)
                               if self.num_shared else None)

    def process_weights_after_loading(self) -> None:
        if self.shared_experts is None:
            return
        size = self.intermediate_size
        gate_up = self.shared_experts.gate_up_proj
        gate, up = (gate_up.weight[gate_up.shard_slice(shard)] for shard in ("gate", "up"))  # [S*I, H] each
        down = self.shared_experts.down_proj.weight  # [H, S*I]
        for index in range(self.num_shared):
            rows = slice(index * size, (index + 1) * size)
            self.experts.load_shared_expert(index, torch.cat([gate[rows], up[rows]]), down[:, rows])
        self.shared_experts = None  # its weights live in the experts now

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states), ctx,
                            correction_bias=self.gate.e_score_correction_bias)  # [num_tokens, hidden]


class DenseMLP(GatedMLP):
    """The plain gated MLP of the first dense layers."""

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return super().forward(hidden_states)


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """``mlp_layer_types[i] == "sparse"`` where the config lists them (DeepSeek-V3.2, GLM-5),
    else ``i >= first_k_dense_replace`` (DeepSeek-V3)."""
    mlp_types = getattr(hf_config, "mlp_layer_types", None)
    if mlp_types:
        if len(mlp_types) != hf_config.num_hidden_layers or set(mlp_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must hold 'dense' or 'sparse' for each of the "
                             f"{hf_config.num_hidden_layers} layers, got {mlp_types!r}")
        return mlp_types[layer_idx] == "sparse"
    moe_layer_freq = getattr(hf_config, "moe_layer_freq", None) or 1
    if moe_layer_freq != 1:  # transformers puts the MoE on every layer past the dense ones
        raise ValueError(f"moe_layer_freq={moe_layer_freq} is not supported: DeepSeek-V3 layers past "
                         f"first_k_dense_replace are all MoE (moe_layer_freq 1)")
    return layer_idx >= (hf_config.first_k_dense_replace or 0)


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: MLA, then a dense MLP or the MoE."""

    def __init__(self, hf_config: Any, layer_idx: int, attention: MLAAttention, moe: bool | None = None):
        """``moe``: the MLP's kind; None: as the config places it (``is_moe_layer``)."""
        super().__init__()
        hidden = hf_config.hidden_size
        self.self_attn = attention
        moe = is_moe_layer(hf_config, layer_idx) if moe is None else moe
        self.mlp = (DeepseekMoE(hf_config) if moe
                    else DenseMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act))
        self.input_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None before the first layer
        ctx: ForwardContext,
        selected: SelectedKeys | None = None,  # the forward's shared top-k (MLAAttention.forward)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, ctx, selected)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states, ctx), residual


def num_mtp_layers(hf_config: Any) -> int:
    """The MTP modules the config declares (``num_nextn_predict_layers``; absent or null: none)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", None) or 0)


def mtp_layer_pattern(num_layers: int, num_mtp: int) -> str:
    """Checkpoint names of the MTP modules the config declares: layers ``num_layers`` to
    ``num_layers + num_mtp - 1``. Any other layer past the last is no part of the model, and
    loading refuses it as an unexpected tensor (a config with too few layers must not serve a
    truncated model)."""
    mtp_layers = "|".join(str(index) for index in range(num_layers, num_layers + num_mtp))
    return rf"^model\.layers\.(?:{mtp_layers})\."


def ignored_checkpoint_patterns(hf_config: Any) -> tuple[str, ...]:
    """What a DeepSeek-style model skips in its checkpoint: the rotary caches, and the declared
    MTP modules (``num_nextn_predict_layers``, loaded by the ``mtp`` draft head where there is one)."""
    num_mtp = num_mtp_layers(hf_config)
    mtp = (mtp_layer_pattern(hf_config.num_hidden_layers, num_mtp),) if num_mtp else ()
    return (r"rotary_emb\.inv_freq$", *mtp)


def mla_rotary_of(model_cls: type, hf_config: Any, max_positions: int) -> RotaryEmbedding:
    """The MLA rotary embedding of ``model_cls``'s checkpoints (its default interleaving where the
    config says nothing)."""
    interleaved = getattr(hf_config, "rope_interleave", None)
    return mla_rotary(hf_config, max_positions,
                      model_cls.interleaved_rope_default if interleaved is None else bool(interleaved))


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """One next-token-prediction module (checkpoint ``model.layers.{num_hidden_layers + i}.*``):
    the decoder block, always MoE (as transformers builds it), with its input projection and the
    norm before the shared head."""

    def __init__(self, hf_config: Any, layer_idx: int, attention: MLAAttention):
        super().__init__(hf_config, layer_idx, attention, moe=True)
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)


class DeepseekV3MTP(TargetSharedHead):
    """DeepSeek-V3's multi-token-prediction modules as a draft head (``speculative_config``
    method ``mtp``; transformers' ``MtpModel``). A pass at position ``p`` takes the
    token at ``p + 1`` and a hidden state of ``p`` (the target's final one, post-norm, then the
    module's own output)::

        x = eh_proj(cat[enorm(embed(token)), hnorm(hidden)])
        h = block(x)                             # MLA + MoE, its own latent cache
        logits = lm_head(shared_head.norm(h))

    Pass ``j`` runs module ``j % num_nextn_predict_layers``, and a pass after the first takes the
    previous pass's ``h`` before ``shared_head.norm``, as vLLM's ``deepseek_mtp`` runs them. Only
    the first pass covers the step's tokens, so a second module (no released checkpoint has one)
    holds KV only of the positions its one-token passes wrote, as in vLLM; drafts stay lossless.
    transformers differs past the first draft: it chains module ``i`` into module ``i + 1`` on the
    normed output and drafts one token per module (one, for the released checkpoints).
    The embedding and the LM head are the target's (``bind_target``). The checkpoint's copies of
    them in each module are skipped, as transformers skips them.
    """

    stacked_params = STACKED_PARAMS
    stacked_param_patterns = PER_EXPERT_PATTERNS

    @staticmethod
    def checkpoint_pattern(hf_config: Any) -> str:
        """The checkpoint names this head loads (a regular expression)."""
        return mtp_layer_pattern(hf_config.num_hidden_layers, max(num_mtp_layers(hf_config), 1))  # 0: __init__ refuses

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        num_layers = hf_config.num_hidden_layers
        num_mtp = num_mtp_layers(hf_config)
        if num_mtp < 1:
            raise ValueError("num_nextn_predict_layers is 0 in the config: the checkpoint has no MTP module")
        self.ignored_checkpoint_patterns = (r"rotary_emb\.inv_freq$",
                                            r"^model\.layers\.\d+\.(?:shared_head\.head|embed_tokens)\.")
        self.rotary_emb = mla_rotary_of(DeepseekV3ForCausalLM, hf_config, config.max_model_len)
        self.first_layer = num_layers  # the modules' checkpoint indices: num_layers on
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({
            str(layer_idx): DeepseekMTPLayer(hf_config, layer_idx, MLAAttention(
                hf_config, layer_idx, self.rotary_emb, self.make_indexer(hf_config, layer_idx, config.max_model_len)))
            for layer_idx in range(num_layers, num_layers + num_mtp)})

    def make_indexer(self, hf_config: Any, layer_idx: int, max_positions: int) -> nn.Module | None:
        """A module's indexer, where its attention is sparse (DeepSeek-V3.2's head); V3's is dense."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits' input, the next pass's hidden), both ``[num_tokens, hidden]``."""
        embed_tokens = self.embedding()
        layer = self.model.layers[str(self.first_layer + step % len(self.model.layers))]
        x = layer.eh_proj(torch.cat([layer.enorm(embed_tokens(input_ids)), layer.hnorm(hidden)], dim=-1))
        x, residual = layer(positions, x, None, ctx)
        out, chained = layer.shared_head.norm(x, residual)
        return out, chained

    def attention_layers(self) -> list[MLALayerSpec]:
        return [layer.self_attn.spec for layer in self.model.layers.values()]


class DeepseekV3ForCausalLM(nn.Module):
    """The Weir model contract (``weir.model_interface``) for DeepSeek-V3 checkpoints.

    The MTP layers are skipped here (as transformers skips them); speculative decoding's ``mtp``
    method loads them into ``DeepseekV3MTP``, the ``mtp_head_class``. FP8 checkpoints are refused
    when the config is read. Subclasses give sparse layers an indexer (``make_indexer``).
    """

    stacked_params = STACKED_PARAMS
    stacked_param_patterns = PER_EXPERT_PATTERNS
    interleaved_rope_default = True  # DeepSeek-V3's rope_interleave when the config leaves it out
    mtp_head_class: type[nn.Module] | None = DeepseekV3MTP

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        num_layers = hf_config.num_hidden_layers
        self.ignored_checkpoint_patterns = ignored_checkpoint_patterns(hf_config)
        num_mtp = num_mtp_layers(hf_config)
        if num_mtp:
            use = ("speculative_config method 'mtp' loads them as its draft head" if self.mtp_head_class is not None
                   else "Weir has no draft head for them")
            logger.info("%s: the checkpoint's %d MTP layer(s) (model.layers.%d.* on) are not part of the model; %s",
                        type(self).__name__, num_mtp, num_layers, use)
        self.rotary_emb = mla_rotary_of(type(self), hf_config, config.max_model_len)
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        layers = []
        for layer_idx in range(num_layers):
            shared = self.shares_topk(hf_config, layer_idx)
            indexer = None if shared else self.make_indexer(hf_config, layer_idx, config.max_model_len)
            layers.append(DeepseekDecoderLayer(hf_config, layer_idx, MLAAttention(
                hf_config, layer_idx, self.rotary_emb, indexer, shares_topk=shared)))
        self.model.layers = nn.ModuleList(layers)
        # Layers that share a top-k read the one the forward's last layer with an indexer left.
        self.has_shared_topk = any(layer.self_attn.spec.shares_topk for layer in self.model.layers)
        self.model.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        tied = self.model.embed_tokens if getattr(hf_config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf_config.hidden_size, hf_config.vocab_size, tie_to=tied)

    def make_indexer(self, hf_config: Any, layer_idx: int, max_positions: int) -> nn.Module | None:
        """The layer's lightning indexer; None: a dense MLA layer (every DeepSeek-V3 layer)."""
        return None

    def shares_topk(self, hf_config: Any, layer_idx: int) -> bool:
        """Whether the layer is sparse with no indexer of its own, attending to the keys the last
        layer before it with one picked (GLM-5's "shared" layers)."""
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden_states = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        selected = SelectedKeys() if self.has_shared_topk else None
        for layer in self.model.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx, selected)
        hidden_states, _ = self.model.norm(hidden_states, residual)
        return hidden_states  # [num_tokens, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [num_rows, vocab]

    def attention_layers(self) -> list[MLALayerSpec]:
        return [layer.self_attn.spec for layer in self.model.layers]
