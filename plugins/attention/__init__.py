"""Weir's built-in attention backends."""

from weir.hookspecs import AttentionBackendSpec, hookimpl


@hookimpl
def weir_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec("torch", "weir.plugins.attention.torch_ref:TorchAttentionBackend"),
        AttentionBackendSpec("triton", "weir.plugins.attention.triton_paged:TritonAttentionBackend"),
        AttentionBackendSpec("triton_mla", "weir.plugins.attention.mla_triton:TritonMLABackend"),
        AttentionBackendSpec("gdn_torch", "weir.plugins.attention.gdn_torch:TorchGDNBackend"),
        AttentionBackendSpec("gdn_fla", "weir.plugins.attention.gdn_fla:FlaGDNBackend"),
        AttentionBackendSpec("mla_torch", "weir.plugins.attention.mla_torch:TorchMLABackend"),
        AttentionBackendSpec("kda_torch", "weir.plugins.attention.kda_torch:TorchKDABackend"),
        AttentionBackendSpec("kda_fla", "weir.plugins.attention.kda_fla:FlaKDABackend"),
    ]
