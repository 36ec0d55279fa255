"""Llama (``LlamaForCausalLM``): pre-norm decoder of RoPE self-attention and a gated MLP.

Also the skeleton of the Qwen family (Qwen3 only changes ``attention_options``) and of Mistral
(a sliding window on every layer). Sliding windows follow the config's ``layer_types``
(``weir.layers.attention.sliding_windows_of``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weir.attention import AttentionLayerSpec
from weir.layer_cache import ForwardContext
from weir.config import ModelConfig
from weir.layers import (QKV_GATE_UP_STACKED_PARAMS, GatedMLP, LMHead, RMSNorm, RopeSelfAttention,
                         RotaryEmbedding, VocabEmbedding, head_dim_of, num_kv_heads_of)
from weir.layers.attention import sliding_windows_of


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 attention_options: dict[str, Any], sliding_window: int | None = None):
        super().__init__()
        hidden = hf_config.hidden_size
        self.self_attn = RopeSelfAttention(
            hidden, hf_config.num_attention_heads, num_kv_heads_of(hf_config), head_dim_of(hf_config),
            layer_idx, rotary_emb, sliding_window=sliding_window, **attention_options)
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act,
                            bias=getattr(hf_config, "mlp_bias", False))
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
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention_options: dict[str, Any], sliding_windows: list[int | None]):
        super().__init__()
        hf_config = config.hf_config
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # One cos/sin cache shared by every layer.
        self.rotary_emb = RotaryEmbedding(hf_config, head_dim_of(hf_config), config.max_model_len)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, layer_idx, self.rotary_emb, attention_options, sliding_windows[layer_idx])
            for layer_idx in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The Weir model contract (``weir.model_interface``) for Llama checkpoints."""

    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    ignored_checkpoint_patterns = (r"rotary_emb\.inv_freq$",)
    # A scalar sliding_window without layer_types: every layer's window (Mistral), or refused.
    window_on_every_layer = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf_config = config.hf_config
        windows = sliding_windows_of(hf_config, config.max_model_len, self.window_on_every_layer)
        self.model = LlamaModel(config, self.attention_options(hf_config), windows)
        tied = self.model.embed_tokens if getattr(hf_config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf_config.hidden_size, hf_config.vocab_size, tie_to=tied)

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, Any]:
        """Keyword arguments of ``RopeSelfAttention`` that differ between the Llama-like families."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm_eps": None}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [num_rows, vocab]

    def attention_layers(self) -> list[AttentionLayerSpec]:
        return [layer.self_attn.attn.spec for layer in self.model.layers]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with ``sliding_window`` on every layer (None in later releases: full attention)."""

    window_on_every_layer = True
