"""The hook implementations Weir loads through the ``weir`` entry point.

Kept free of torch imports: Weir imports every plugin at start-up, and the model module named in
the spec is imported only when a Qwen2 checkpoint is actually served.
"""

from __future__ import annotations

from weir.hookspecs import ModelSpec, hookimpl


@hookimpl
def weir_models() -> list[ModelSpec]:
    """Qwen2 dense decoders (Qwen2, Qwen2.5)."""
    return [ModelSpec("Qwen2ForCausalLM", "weir_plugin_qwen2.model:Qwen2ForCausalLM")]
