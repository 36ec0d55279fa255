"""Process-wide settings, made by the entry points (``weir.LLM``, the CLI commands), not by
``LLMEngine``: a program that builds an engine itself keeps its own settings."""

from __future__ import annotations

import gc

# gc.set_threshold's (generation 0, 1, 2) thresholds.
STEP_LOOP_GC_THRESHOLDS = (20_000, 50, 1_000)


def set_step_loop_gc_thresholds() -> None:
    """Collect young objects less often and the old generation almost never.

    The step loop allocates many short-lived objects, and each full collection rescans
    everything built at start-up (modules, tokenizer tables): over 1 ms per step with 256
    requests under the default thresholds (``python3 -m benchmarks.host_overhead --default-gc``).
    No ``gc.freeze()``: a frozen object in a reference cycle is never collected, so an engine
    alive when the next one froze (a test fixture, a replaced LLM) kept its GPU memory for the
    life of the process.
    """
    gc.set_threshold(*STEP_LOOP_GC_THRESHOLDS)
