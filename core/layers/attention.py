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

    Covers Llama (``attention_bias`` on all four projections), Qwen2 (bias on q/k/v only),
    Qwen3 (per-head ``q_norm``/``k_norm`` before RoPE) and Granite SWA (a sliding window on
    some layers, learnt per-head ``sinks``, no RoPE where ``rotary_emb`` is None). The rotary
    module is shared by the layers of a model that use the same frequencies (one cos/sin cache).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        rotary_emb: RotaryEmbedding | None,  # None: no position embedding (NoPE)
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,  # None: no q/k norm
        scale: float | None = None,  # None: head_dim ** -0.5
        sliding_window: int | None = None,
        has_sinks: bool = False,
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
        if qk_norm_eps is not None and rotary_emb is None:
            raise ValueError("q/k norms are applied with RoPE: a layer without RoPE cannot have them")
        self.rotary_emb = rotary_emb
        # Checkpoints name it self_attn.sinks; any float dtype: the backends read it in fp32.
        self.sinks = nn.Parameter(torch.empty(num_heads)) if has_sinks else None
        self.attn = Attention(AttentionLayerSpec(
            layer_idx=layer_idx, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, scale=scale if scale is not None else head_dim ** -0.5,
            sliding_window=sliding_window, has_sinks=has_sinks))

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
        elif self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        attn_out = self.attn(q, k, v, ctx, self.sinks)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(attn_out.reshape(num_tokens, self.num_heads * self.head_dim))


def sliding_windows_of(hf_config: Any, max_model_len: int, window_on_every_layer: bool = False) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers reads the config.

    ``layer_types`` (``full_attention`` / ``sliding_attention``, as Qwen2/Qwen3 build it from
    ``use_sliding_window`` and ``max_window_layers``, and Granite SWA sets it) decides per layer;
    without it, a scalar ``sliding_window`` applies to every layer only for architectures that
    say so (``window_on_every_layer``: Mistral, whose window transformers applies to every layer
    whatever ``layer_types`` says); any other model refuses it unless every sequence
    fits in the window (``require_full_attention``). A window no shorter than ``max_model_len``
    sees the whole sequence, so it is full attention.
    """
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None)
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", None) is False:  # Qwen2-style configs switch it off
        window = None
    if window and window_on_every_layer:  # Mistral: transformers ignores layer_types there
        windows = [window] * num_layers
    elif layer_types:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{type(hf_config).__name__}: layer_types {unknown} are not supported by this model "
                             "implementation (full_attention and sliding_attention are)")
        if len(layer_types) != num_layers:
            raise ValueError(f"{type(hf_config).__name__}: layer_types has {len(layer_types)} entries for "
                             f"{num_layers} layers")
        if "sliding_attention" in layer_types and (isinstance(window, bool) or not isinstance(window, int)
                                                   or window < 1):
            raise ValueError(f"{type(hf_config).__name__}: sliding_attention layers need a positive integer "
                             f"sliding_window, got {window!r}")
        windows = [window if kind == "sliding_attention" else None for kind in layer_types]
    else:
        require_full_attention(hf_config, max_model_len)
        windows = [None] * num_layers
    return [None if w is not None and w >= max_model_len else w for w in windows]


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
