"""Qwen2 as a third-party Weir plugin: Qwen3 without q/k norm, with bias on q/k/v only.

A model plugin needs only Weir's contract (``weir.model_interface``); here it reuses the
built-in Llama skeleton and changes the attention options, as Weir's own Qwen3 does. Parameter
names mirror Hugging Face's, so Weir's loader maps the checkpoint through ``stacked_params``.
"""

from __future__ import annotations

from typing import Any

from weir.plugins.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    # Qwen2's optional sliding-window layers (use_sliding_window) come with the Llama skeleton: it
    # reads them from the layer_types transformers builds from max_window_layers.

    @classmethod
    def attention_options(cls, hf_config: Any) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm_eps": None}
