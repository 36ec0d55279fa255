"""The hooks: specs only, no torch import (a target is imported when a run selects it).

Linear-attention backends register through ``weir_attention_backends`` like paged ones; the
class's ``supported_layer_kinds`` tell Weir which layers it serves.
"""

from __future__ import annotations

from weir import AttentionBackendSpec, MoEBackendSpec, hookimpl


@hookimpl
def weir_moe_backends() -> list[MoEBackendSpec]:
    return [MoEBackendSpec("loop_moe", "weir_plugin_backends.moe_loop:LoopMoEBackend")]


@hookimpl
def weir_attention_backends() -> list[AttentionBackendSpec]:
    return [AttentionBackendSpec("gdn_naive", "weir_plugin_backends.gdn_naive:NaiveGDNBackend")]
