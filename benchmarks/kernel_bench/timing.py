"""CUDA timings shared by the kernel benchmarks.

Every timer first calls the function ``warmup`` times (Triton compiles on the first call and
the caching allocator grows), then measures between CUDA events:

- ``median_ms`` / ``median_us``: the median of single calls (one event pair each); launch
  overhead included;
- ``loop_us``: the mean of ``iters`` back-to-back calls, as an eager step pays them;
- ``graph_us``: the calls replayed from one CUDA graph, device time without Python's launch cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def _warm_up(fn: Callable[[], object], warmup: int) -> None:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], iters: int = 50, warmup: int = 3) -> float:
    """Median milliseconds of one ``fn()`` call."""
    _warm_up(fn, warmup)
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def median_us(fn: Callable[[], object], iters: int = 50, warmup: int = 3) -> float:
    """Median microseconds of one ``fn()`` call."""
    return median_ms(fn, iters, warmup) * 1e3


def loop_us(fn: Callable[[], object], iters: int = 200, warmup: int = 3) -> float:
    """Microseconds per call of ``iters`` calls issued back to back (queued launches overlap)."""
    _warm_up(fn, warmup)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def graph_replay(fn: Callable[[], object], repeats: int = 1, warmup: int = 3) -> Callable[[], None]:
    """A CUDA graph of ``repeats`` back-to-back ``fn()`` calls; returns its ``replay``.

    The warm-up runs on a side stream, as ``torch.cuda.graphs`` advises: compiling or allocating
    while capturing would fail. ``fn`` is called ``repeats`` times during capture, so a function
    that cycles over inputs (to defeat the L2 cache) bakes its sequence into the graph.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return graph.replay


def graph_us(fn: Callable[[], object], repeats: int = 1, iters: int = 20, warmup: int = 3) -> float:
    """Microseconds per ``fn()`` call: the median replay of a graph of ``repeats`` calls, divided."""
    return median_ms(graph_replay(fn, repeats, warmup), iters, warmup=1) * 1e3 / repeats
