"""Weir's built-in model architectures, registered like any third-party plugin.

Importing this module stays light (no torch): the targets are imported only when selected.
"""

from __future__ import annotations

from weir.hookspecs import ModelSpec, hookimpl


@hookimpl
def weir_models() -> list[ModelSpec]:
    """Dense decoders (Llama, Mistral, Qwen3, Granite SWA), hybrid Qwen3-Next, GraniteMoe SWA, the
    MLA models: DeepSeek-V3 (Kimi-K2-style text models too), DeepSeek-V3.2 and GLM-5 (DSA), and
    hybrid Kimi Linear (Kimi Delta Attention + MLA without RoPE)."""
    return [
        ModelSpec("LlamaForCausalLM", "weir.plugins.models.llama:LlamaForCausalLM"),
        ModelSpec("MistralForCausalLM", "weir.plugins.models.llama:MistralForCausalLM"),
        ModelSpec("GraniteSWAForCausalLM", "weir.plugins.models.granite_swa:GraniteSWAForCausalLM"),
        ModelSpec("GraniteMoeSWAForCausalLM", "weir.plugins.models.granite_swa:GraniteMoeSWAForCausalLM"),
        ModelSpec("Qwen3ForCausalLM", "weir.plugins.models.qwen3:Qwen3ForCausalLM"),
        ModelSpec("Qwen3NextForCausalLM", "weir.plugins.models.qwen3_next:Qwen3NextForCausalLM"),
        ModelSpec("DeepseekV3ForCausalLM", "weir.plugins.models.deepseek_v3:DeepseekV3ForCausalLM"),
        ModelSpec("DeepseekV32ForCausalLM", "weir.plugins.models.deepseek_v32:DeepseekV32ForCausalLM"),
        ModelSpec("GlmMoeDsaForCausalLM", "weir.plugins.models.deepseek_v32:GlmMoeDsaForCausalLM"),
        ModelSpec("KimiLinearForCausalLM", "weir.plugins.models.kimi_linear:KimiLinearForCausalLM"),
    ]
