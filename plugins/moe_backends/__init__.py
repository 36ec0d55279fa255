"""Weir's built-in MoE (expert computation) backends."""

from weir.hookspecs import MoEBackendSpec, hookimpl


@hookimpl
def weir_moe_backends() -> list[MoEBackendSpec]:
    return [
        MoEBackendSpec("torch", "weir.plugins.moe_backends.torch_ref:TorchMoEBackend"),
        MoEBackendSpec("triton", "weir.plugins.moe_backends.triton_fused:TritonMoEBackend"),
    ]
