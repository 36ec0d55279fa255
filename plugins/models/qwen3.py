"""Qwen3 (``Qwen3ForCausalLM``): Llama plus a per-head RMSNorm on q and k before RoPE.

Same weights layout as Llama otherwise (``self_attn.q_norm``/``k_norm`` of size head_dim are
extra); ``head_dim`` is explicit in the config and need not be hidden/heads.
"""

from __future__ import annotations

from typing import Any

from weir.plugins.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    # Sliding-window layers (use_sliding_window) are off on every released Qwen3; configs that
    # turn them on are refused by LlamaForCausalLM's require_full_attention.

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, Any]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm_eps": hf_config.rms_norm_eps}
