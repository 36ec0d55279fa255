"""Built-in platform drivers: CUDA, ROCm, XPU and the CPU fallback.

Only specs are returned here; the driver modules (which import torch) load when resolved.
"""

from __future__ import annotations

from weir.hookspecs import PlatformSpec, hookimpl

_PACKAGE = "weir.plugins.platforms"


@hookimpl
def weir_platforms() -> list[PlatformSpec]:
    # CUDA and ROCm never are both available (a torch build is one or the other), so they can
    # share a priority; every accelerator outranks the CPU.
    return [
        PlatformSpec("cuda", f"{_PACKAGE}.cuda:CudaPlatform", priority=30),
        PlatformSpec("rocm", f"{_PACKAGE}.rocm:RocmPlatform", priority=30),
        PlatformSpec("xpu", f"{_PACKAGE}.xpu:XpuPlatform", priority=20),
        PlatformSpec("cpu", f"{_PACKAGE}.cpu:CpuPlatform", priority=0),
    ]
