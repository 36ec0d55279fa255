"""Qwen3 (``Qwen3ForCausalLM``): Llama plus a per-head RMSNorm on q and k before RoPE.

Same weights layout as Llama otherwise (``self_attn.q_norm``/``k_norm`` of size head_dim are
extra); ``head_dim`` is explicit in the config and need not be hidden/heads.
"""

from __future__ import annotations

from typing import Any

from weir.plugins.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    # Sliding-window layers (use_sliding_window, off on every released Qwen3) come from the
    # config's layer_types, which transformers builds from max_window_layers.

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, Any]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm_eps": hf_config.rms_norm_eps}
