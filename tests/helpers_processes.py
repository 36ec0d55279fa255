"""Finding a test's child processes by their command lines (Linux: reads /proc), for the tests
that stop a benchmark script and check that nothing it started outlives it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

HAS_PROC = Path("/proc/self/cmdline").exists()


def processes_naming(*texts: str) -> list[int]:
    """Pids of the processes whose command line contains every one of ``texts``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                if all(text in cmdline for text in texts):
                    pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return pids


def assert_all_gone(pids: Callable[[], list[int]], seconds: float = 10) -> None:
    """``pids()`` comes back empty within ``seconds``."""
    deadline = time.monotonic() + seconds
    while pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pids(), f"still running: {pids()}"
