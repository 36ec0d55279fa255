"""Compiling the kernel variants a server will launch, before the first request, in parallel.

A cold start spends most of its time in Triton's compiler, one variant at a time, as the
profiling run and the graph capture first launch each. The warm-up tasks here are dummy steps
(``ModelRunner.dummy_run``: the real step path on fake requests) that launch every variant real
steps will use: tiny whole-model forwards (every layer's kernels once), decode batches of 1, 2 and
16 rows (kernels that specialise on the token count, the one-row GEMV), a step at each attention
shape the backends name (``AttentionBackend.warmup_shapes``: prefill tiles, decode split counts)
and the sampler at each filter kind.

For dense models on CUDA the tasks first run as a compile-ahead pass (``compile_ahead``): every
Triton launch in this thread becomes a compile-only warm-up that Triton's ``AsyncCompileMode``
hands to a thread pool, so all variants compile at once (the compiler works mostly outside the
GIL: MLIR passes, ptxas); then each compiled kernel loads its module in the pool. The tasks then
run for real, one after another in this thread, and find everything compiled and loaded.

Launches stay in one thread because Triton's ``CompiledKernel`` is not safe to launch from two
threads before its first launch has finished loading it (``_init_handles`` publishes the
launcher before the function handle). Models where a skipped kernel would leave garbage that a
torch op indexes with (MoE routing, linear-attention states), or whose kernels autotune (fla),
skip the compile-ahead pass and compile as the tasks run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from weir.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_WARMUP_THREADS = 16
SAMPLING_KINDS = (
    SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, logprobs=2),
)


def attention_shapes(runner) -> list[tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) of the steps whose attention kernel variants real steps will use
    (``AttentionBackend.warmup_shapes``, for one layer of each distinct shape and kind)."""
    scheduler = runner.config.scheduler
    max_prefill_len = min(256, scheduler.max_num_batched_tokens - 1, scheduler.max_model_len)
    decode_batches = runner.capture_sizes[::-1] if runner.use_graphs else []  # captured largest first
    shapes = []
    for layer in distinct_paged_layers(runner):
        warmup_shapes = getattr(runner.caches.backend_of(layer), "warmup_shapes", None)
        if warmup_shapes is not None:
            for shape in warmup_shapes(layer, max_prefill_len, decode_batches, scheduler.max_model_len):
                if shape not in shapes:
                    shapes.append(shape)
    return shapes


def distinct_paged_layers(runner) -> list:
    """One paged layer per distinct spec apart from its index (most models have one or two)."""
    seen = {}
    for layer in runner.caches.paged_layers:  # specs are frozen dataclasses: hashable, replaceable
        seen.setdefault(dataclasses.replace(layer, layer_idx=0), layer)
    return list(seen.values())


def warmup_tasks(runner, sampling_kinds: tuple[SamplingParams, ...] = SAMPLING_KINDS) -> list:
    """Dummy steps that between them launch every kernel variant: whole-model forwards at a few
    batch shapes (kernels that specialise on the token count, the one-row GEMV), every attention
    shape the backends name (prefill tiles, decode split counts, as graphs will be captured), and
    the sampler at each filter kind (each is its own kernel variant), in one batch and alone."""
    forwards = [(query_lens, None, None) for query_lens in ([1, 2], [1], [1, 1], [1] * 16)]
    attention = [(query_lens, [seq - query for seq, query in zip(seq_lens, query_lens)], None)
                 for query_lens, seq_lens in attention_shapes(runner)]
    sampling = [([1] * len(kinds), None, list(kinds))
                for kinds in (sampling_kinds, sampling_kinds[1:2], sampling_kinds[2:3])]
    limit = runner.max_running_reqs  # no real step holds more requests (nor has the table more rows)
    token_budget = runner.config.scheduler.max_num_batched_tokens  # nor more tokens
    tasks = []
    for query_lens, context_lens, params in forwards + attention + sampling:
        query_lens = query_lens[:limit]
        if sum(query_lens) <= token_budget:
            tasks.append((runner.dummy_run, (query_lens, context_lens and context_lens[:limit],
                                             params and params[:limit], "off")))
    speculative = getattr(runner.config, "speculative", None)
    if speculative is not None:  # verification (1 + k tokens a request) and proposing after it
        width = 1 + speculative.num_speculative_tokens
        # With graphs, as the verify graphs will run it: their plan also zeroes the rows of
        # tokens past the last request, a kernel that must not first load inside a capture.
        graph_mode = "warm" if runner.use_graphs else "off"
        for num_reqs in (1, 2, 16):
            num_reqs = min(num_reqs, limit, max(1, token_budget // width))
            tasks.append((runner.dummy_run, ([width] * num_reqs, None, None, graph_mode, [width - 1] * num_reqs)))
    return tasks


def compile_kernel_variants(runner) -> bool:
    """Launch every kernel variant once (see the module docstring); returns when all finished,
    True when they were compiled ahead (every variant a step uses is then loaded)."""
    start = time.perf_counter()
    # The sampler's logprobs kind indexes with sampled ids, which a compile-only pass leaves unwritten.
    ahead = compile_ahead_safe(runner) and compile_ahead(runner, warmup_tasks(runner, SAMPLING_KINDS[:-1]))
    tasks = warmup_tasks(runner)
    for fn, args in tasks:
        fn(*args)
    runner.platform.synchronize()
    logger.info("kernel variants %s in %.1f s (%d dummy steps)",
                "compiled ahead and launched" if ahead else "compiled and launched", time.perf_counter() - start,
                len(tasks))
    return ahead


COMPILE_AHEAD_ENV = "WEIR_COMPILE_AHEAD"  # "0" turns the compile-ahead pass off


def compile_ahead_safe(runner) -> bool:
    """Whether a forward whose Triton kernels do not run is harmless for this model: only when
    no torch op indexes with a Triton kernel's output (MoE routing, linear-attention state
    kernels and speculative draft models do) and every kernel compiles without autotuning (fla's
    would time no-ops)."""
    # Draft models and heads gather their inputs into fresh tensors, which a skipped kernel leaves
    # unwritten, and index embeddings and KV slots with them.
    speculative = getattr(runner.config, "speculative", None)
    drafts_by_model = speculative is not None and speculative.uses_draft_model
    return (runner.device.type == "cuda" and not runner.caches.state_layers and runner.moe_backend is None
            and not drafts_by_model and os.environ.get(COMPILE_AHEAD_ENV, "1") != "0")


class _CompileOnly(threading.local):
    active = False


# compile_ahead patches a class of Triton's, which every thread of the process shares: one at a time.
_COMPILE_AHEAD_LOCK = threading.Lock()


def compile_ahead(runner, tasks, num_threads: int | None = None) -> bool:
    """Run ``tasks`` in this thread with each Triton launch replaced by a compile-only warm-up
    (``KernelInterface.run(warmup=True)``) under Triton's ``AsyncCompileMode``: every variant
    compiles in a pool at once, none launches; then each compiled kernel loads its module, also
    in the pool. Device buffers the kernels would have written keep whatever they held, which
    ``compile_ahead_safe`` makes harmless. Returns False (the tasks then compile as they run)
    when this Triton lacks the machinery, another compile mode is active, or anything raised."""
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return False
    if _async_compile.active_mode.get() is not None or not _COMPILE_AHEAD_LOCK.acquire(blocking=False):
        return False
    start = time.perf_counter()
    num_threads = num_threads or max(1, min(MAX_WARMUP_THREADS, os.cpu_count() or 1))
    compile_only = _CompileOnly()
    compiled: list = []  # what each skipped launch returned: a kernel, or a future of one
    launch = KernelInterface.__getitem__

    def launch_or_compile(kernel, grid):
        if not compile_only.active:  # other threads (none should launch now) launch as usual
            return lambda *args, **kwargs: kernel.run(*args, grid=grid, warmup=False, **kwargs)
        return lambda *args, **kwargs: compiled.append(kernel.run(*args, grid=grid, warmup=True, **kwargs))

    KernelInterface.__getitem__ = launch_or_compile
    compile_only.active = True
    try:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="weir-compile") as pool:
            with _async_compile.AsyncCompileMode(pool):
                for fn, args in tasks:
                    fn(*args)
            compile_only.active = False
            kernels = {id(kernel): kernel for kernel in (_result(item) for item in compiled) if kernel is not None}
            # Distinct kernels load in parallel (on Triton 3.6 each also builds its launcher with gcc).
            for future in [pool.submit(_load, runner.device, kernel) for kernel in kernels.values()]:
                future.result()
    except Exception as error:  # noqa: BLE001 - the tasks compile again as they run and report real errors
        _async_compile.active_mode.set(None)  # ours (checked free above); Triton leaves it set when a compile raised
        logger.warning("compile-ahead pass failed (%s: %s); compiling while warming up instead",
                       type(error).__name__, error)
        return False
    finally:
        compile_only.active = False
        KernelInterface.__getitem__ = launch
        _COMPILE_AHEAD_LOCK.release()
    runner.platform.synchronize()
    logger.info("compile-ahead: %d kernels compiled and loaded in %.1f s", len(kernels), time.perf_counter() - start)
    return True


def _result(item):
    """A compile-only launch returns the compiled kernel, a future of it (async mode) or None."""
    return item.result() if hasattr(item, "result") else item


def _load(device: torch.device, kernel) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kernel.run  # noqa: B018 - the property loads the module and builds the launcher on first use
