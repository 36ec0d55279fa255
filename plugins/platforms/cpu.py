"""The CPU platform: always available, gloo collectives, torch reference kernels only."""

from __future__ import annotations

import os

import torch

from weir.platform import Platform

_GIB = 1 << 30
# The automatic CPU KV cache: as large as the weights, within [512 MiB, 4 GiB] and at most 40% of
# the available RAM. A CPU serves few sequences at once (its steps are slow), RAM is shared with
# everything else on the machine, and every byte is zeroed at start-up (4 GiB took seconds and made
# a 135M model's process 5 GB); a cache the size of the weights still holds several full-length
# requests of the small models a CPU runs, and kv_cache_memory_bytes sets any other size.
_CPU_KV_CACHE_MIN_BYTES = _GIB // 2
_CPU_KV_CACHE_CAP_BYTES = 4 * _GIB
_CPU_KV_CACHE_RAM_FRACTION = 0.4


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supports_graphs = False
    supports_triton = False
    pin_memory = False
    preferred_attention_backends = ("torch", "gdn_torch", "mla_torch", "kda_torch")
    preferred_moe_backends = ("torch",)

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        return ""

    def device(self, index: int = 0) -> torch.device:
        # One host memory space: a local rank index means nothing on the CPU.
        return torch.device("cpu")

    @staticmethod
    def _read_meminfo() -> dict[str, int] | None:
        """``/proc/meminfo`` as {field: bytes}, or None where it does not exist (not Linux)."""
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                lines = meminfo.read().splitlines()
        except OSError:
            return None
        fields = {}
        for line in lines:
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                fields[key.strip()] = int(parts[0]) * scale
        return fields

    @staticmethod
    def _sysconf_memory() -> tuple[int, int]:
        page_size = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page_size, os.sysconf("SC_PHYS_PAGES") * page_size

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        meminfo = self._read_meminfo()
        if meminfo and "MemAvailable" in meminfo and "MemTotal" in meminfo:
            # MemAvailable counts reclaimable page cache, which MemFree and sysconf miss.
            return meminfo["MemAvailable"], meminfo["MemTotal"]
        return self._sysconf_memory()

    def synchronize(self, index: int = 0) -> None:
        return None  # CPU ops finish before they return

    def default_kv_cache_bytes(self, model_bytes: int) -> int:
        """min(40% of available RAM, the weights' size clamped to [512 MiB, 4 GiB]).

        Called after the weights are loaded, so available RAM already excludes ``model_bytes``.
        """
        available_bytes, _ = self.memory_info()
        wanted = min(_CPU_KV_CACHE_CAP_BYTES, max(_CPU_KV_CACHE_MIN_BYTES, model_bytes))
        return min(wanted, int(available_bytes * _CPU_KV_CACHE_RAM_FRACTION))
