"""Attention through the selected backend, and the RoPE self-attention block of Llama-like models."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weir.attention import AttentionLayerSpec
from weir.layer_cache import ForwardContext
from weir.layers.linear import Linear, QKVLinear
from weir.layers.norm import RMSNorm
from weir.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """One attention layer's call into the backend; it owns no weights, only its spec."""

    def __init__(self, spec: AttentionLayerSpec):
        super().__init__()
        self.spec = spec

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        ctx: ForwardContext,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32, for a spec with has_sinks
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        layer = ctx.layers[self.spec.layer_idx]
        if self.spec.has_sinks:
            return layer.backend.forward(self.spec, q, k, v, layer.cache, layer.metadata, sinks=sinks)
        return layer.backend.forward(self.spec, q, k, v, layer.cache, layer.metadata)

    def extra_repr(self) -> str:
        return repr(self.spec)


def head_dim_of(hf_config: Any) -> int:
    """``config.head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


class RopeSelfAttention(nn.Module):
    """qkv_proj -> [per-head q/k RMSNorm] -> RoPE -> attention -> o_proj.

    Covers Llama (``attention_bias`` on all four projections), Qwen2 (bias on q/k/v only) and
    Qwen3 (per-head ``q_norm``/``k_norm`` before RoPE). The rotary module is shared by all
    layers of a model (one cos/sin cache).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,  # None: no q/k norm
        scale: float | None = None,  # None: head_dim ** -0.5
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.qkv_proj = QKVLinear(hidden_size, num_heads, num_kv_heads, head_dim, qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(AttentionLayerSpec(
            layer_idx=layer_idx, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, scale=scale if scale is not None else head_dim ** -0.5))

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.rotary_emb.forward_with_norms(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary_emb(positions, q, k)
        attn_out = self.attn(q, k, v, ctx)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(attn_out.reshape(num_tokens, self.num_heads * self.head_dim))


def require_full_attention(hf_config: Any, max_model_len: int | None = None) -> None:
    """Raise when the config asks for attention a plain full-attention model would get wrong:
    other layer kinds, or a ``sliding_window`` (as Mistral and Phi-3 configs set it, with no
    ``layer_types``) that a sequence of ``max_model_len`` tokens could outgrow."""
    layer_types = getattr(hf_config, "layer_types", None) or []
    other_kinds = sorted({kind for kind in layer_types if kind != "full_attention"})
    if other_kinds:
        raise ValueError(f"{type(hf_config).__name__}: layer_types {other_kinds} are not supported "
                         "by this model implementation (only full_attention)")
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", None) is False:  # Qwen2-style configs switch it off
        window = None
    if window and not layer_types and (max_model_len is None or max_model_len > window):
        raise ValueError(f"{type(hf_config).__name__}: sliding_window={window} is not supported by this model "
                         f"implementation (full attention only); with max_model_len <= {window} every token "
                         f"sees the whole sequence and it runs as full attention")
