"""Platform detection and selection, with the torch device probes replaced."""

from __future__ import annotations

import pytest
import torch

from weir.cli.plugins_cmd import describe_plugins
from weir.plugin_manager import load_plugins
from weir.plugins.platforms.cpu import CpuPlatform
from weir.plugins.platforms.cuda import CudaPlatform, TorchCudaPlatformBase
from weir.plugins.platforms.rocm import RocmPlatform
from weir.plugins.platforms.xpu import XpuPlatform

_GIB = 1 << 30


@pytest.fixture
def registry():
    return load_plugins({"builtin_platforms", "builtin_attention", "builtin_moe_backends"})


@pytest.fixture
def machine(monkeypatch):
    """Pretend this machine has the given torch build and devices."""

    def set_machine(cuda: bool = False, hip: str | None = None, xpu: bool = False) -> None:
        monkeypatch.setattr(TorchCudaPlatformBase, "_torch_cuda_available", staticmethod(lambda: cuda))
        monkeypatch.setattr(TorchCudaPlatformBase, "_torch_hip_version", staticmethod(lambda: hip))
        monkeypatch.setattr(XpuPlatform, "_torch_xpu_available", staticmethod(lambda: xpu))

    return set_machine


def _active_names(registry) -> list[str]:
    return [row["name"] for row in describe_plugins(registry) if row["active"]]


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (dict(cuda=True, hip=None), "cuda"),
        (dict(cuda=True, hip="6.4.0"), "rocm"),
        (dict(xpu=True), "xpu"),
        (dict(), "cpu"),
        (dict(cuda=False, hip="6.4.0"), "cpu"),  # ROCm torch build on a machine without a GPU
    ],
)
def test_detection_picks_exactly_one_platform(registry, machine, devices, expected):
    machine(**devices)
    active = registry.select_platform(None)
    assert active.name == expected
    assert _active_names(registry) == [expected]


def test_rocm_build_is_not_cuda(machine):
    machine(cuda=True, hip="6.4.0")
    assert RocmPlatform.is_available() and not CudaPlatform.is_available()
    assert "ROCm build" in CudaPlatform.unavailable_reason()
    assert RocmPlatform.unavailable_reason() == ""


def test_requested_device_unavailable_says_why(registry, machine):
    machine()
    with pytest.raises(RuntimeError, match="'cuda' was requested but is not available: torch reports no CUDA device"):
        registry.select_platform("cuda")
    with pytest.raises(RuntimeError, match="not a ROCm build"):
        registry.select_platform("rocm")
    with pytest.raises(RuntimeError, match="no XPU device"):
        registry.select_platform("xpu")


def test_requested_device_available_wins_over_priority(registry, machine):
    machine(cuda=True)
    assert type(registry.select_platform("cuda")) is CudaPlatform
    assert type(registry.select_platform("cpu")) is CpuPlatform


def test_unknown_device_lists_known_platforms(registry):
    with pytest.raises(ValueError, match="unknown platform 'tpu'; known: cpu, cuda, rocm, xpu"):
        registry.select_platform("tpu")


def test_platform_settings():
    assert (CpuPlatform.dist_backend, CudaPlatform.dist_backend) == ("gloo", "nccl")
    assert (RocmPlatform.dist_backend, XpuPlatform.dist_backend) == ("rccl", "xccl")
    assert RocmPlatform.device_type == CudaPlatform.device_type == "cuda"
    assert CudaPlatform.supports_graphs and not XpuPlatform.supports_graphs
    assert not CpuPlatform.supports_graphs and not CpuPlatform.supports_triton
    assert CudaPlatform.preferred_attention_backends == ("triton", "gdn_fla", "triton_mla", "kda_fla", "torch",
                                                         "gdn_torch", "mla_torch", "kda_torch")
    assert XpuPlatform.preferred_moe_backends == ("torch",)
    assert CpuPlatform.pin_memory is False and CudaPlatform.pin_memory is True
    # Building a device handle touches no device.
    assert CpuPlatform().device(3) == torch.device("cpu")
    assert CudaPlatform().device(1) == torch.device("cuda", 1)


def test_cpu_backends_are_torch(registry, machine):
    machine()
    platform = registry.select_platform(None)
    assert registry.select_attention_backend(platform, {"full_attention"}, None).name == "torch"
    assert registry.select_moe_backend(platform, None).name == "torch"


def test_cpu_memory_info_reads_meminfo_and_falls_back(monkeypatch):
    cpu = CpuPlatform()
    free_bytes, total_bytes = cpu.memory_info()
    assert 0 < free_bytes <= total_bytes
    meminfo = {"MemTotal": 64 * _GIB, "MemAvailable": 5 * _GIB, "MemFree": 1 * _GIB}
    monkeypatch.setattr(CpuPlatform, "_read_meminfo", staticmethod(lambda: meminfo))
    assert cpu.memory_info() == (5 * _GIB, 64 * _GIB)
    monkeypatch.setattr(CpuPlatform, "_read_meminfo", staticmethod(lambda: None))
    monkeypatch.setattr(CpuPlatform, "_sysconf_memory", staticmethod(lambda: (7, 9)))
    assert cpu.memory_info() == (7, 9)


def test_cpu_meminfo_parser_reads_bytes():
    meminfo = CpuPlatform._read_meminfo()
    assert meminfo is not None and meminfo["MemTotal"] % 1024 == 0
    assert meminfo["MemAvailable"] <= meminfo["MemTotal"]


@pytest.mark.parametrize(("available_gib", "model_bytes", "expected_bytes"), [
    (100, _GIB, _GIB),  # the weights' size
    (100, 8 * _GIB, 4 * _GIB),  # capped
    (100, 100 << 20, _GIB // 2),  # a small model still gets room for several long requests
    (5, 8 * _GIB, 2 * _GIB),  # 40% of the available RAM at most
])
def test_cpu_default_kv_cache_follows_the_weights_within_bounds(monkeypatch, available_gib, model_bytes,
                                                                 expected_bytes):
    monkeypatch.setattr(CpuPlatform, "memory_info", lambda self, index=0: (available_gib * _GIB, 128 * _GIB))
    assert CpuPlatform().default_kv_cache_bytes(model_bytes=model_bytes) == expected_bytes


def test_accelerators_do_not_guess_kv_cache_size():
    with pytest.raises(NotImplementedError, match="profiling"):
        CudaPlatform().default_kv_cache_bytes(model_bytes=_GIB)


def test_background_device_setup_waits_and_never_raises(caplog):
    import logging

    assert CpuPlatform().start_device_setup()() is None  # nothing to set up
    with caplog.at_level(logging.DEBUG, logger="weir.plugins.platforms.cuda"):
        CudaPlatform().start_device_setup()()  # returns once the thread ended
    if not torch.cuda.is_available():  # the failure is the engine's to report, later and clearly
        assert "background device set-up failed" in caplog.text
