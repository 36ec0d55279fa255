"""Compiling the kernel variants a server will launch, before the first request, in parallel.

A cold start spends most of its time in Triton's compiler, one variant at a time, as the
profiling run and the graph capture first launch each. The compiler works mostly outside the
GIL (MLIR passes, ptxas), so the variants are launched here from a thread pool instead: a tiny
whole-model forward (every layer's kernels once), the attention backend alone at each
query-length class (prefill tiles) and at each decode batch the graph capture will use (KV split
counts), and the sampler at each filter kind. Each task runs on its own stream with its own
inputs and writes only the scratch cache's null block, so the tasks cannot disturb each other.

Hybrid models run their tiny forward alone first: fla's autotuner times its candidate configs
on the device, and concurrent work would skew what it picks.

Dense models first take a compile-ahead pass (``compile_ahead``): the same tasks run in one
thread with every Triton launch turned into a compile-only warm-up that Triton's
``AsyncCompileMode`` hands to a thread pool, so all variants compile at once instead of one
chain per task; the waves after it then find every kernel compiled.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from weir.attention import AttentionMetadata
from weir.sample.metadata import build_sampling_metadata
from weir.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_WARMUP_THREADS = 16
SAMPLING_KINDS = (
    SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, logprobs=2),
)


def scratch_caches(runner) -> list[torch.Tensor | None]:
    """A one-block KV cache per full-attention layer (block 0, the null block, takes every write)."""
    scratch = [None] * len(runner.kv_caches)
    for layer in runner.attn_layers:
        shape = runner.attn_backend.kv_cache_shape(1, layer)
        scratch[layer.layer_idx] = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
    return scratch


def dummy_metadata(runner, query_lens: list[int], seq_lens: list[int] | None = None) -> AttentionMetadata:
    """Fake requests whose keys all live in the null block (block 0). The block table is as wide
    as a real step's, so kernels specialise on its stride exactly as they will later."""
    device = runner.device
    seq_lens = seq_lens or query_lens
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    positions = np.concatenate([np.arange(seq - n, seq) for n, seq in zip(query_lens, seq_lens)])
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(query_lens), runner.max_blocks_per_req, dtype=torch.int32, device=device),
        slot_mapping=torch.from_numpy(positions % runner.block_size).to(device),
        num_reqs=len(query_lens), num_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


@torch.inference_mode()
def dummy_forward(runner, query_lens: list[int], kv_caches) -> torch.Tensor:
    """A whole-model forward over fake prefill requests; returns their last tokens' logits."""
    metadata = dummy_metadata(runner, query_lens)
    input_ids = torch.zeros(metadata.num_tokens, dtype=torch.int64, device=runner.device)
    positions = torch.cat([torch.arange(n, device=runner.device) for n in query_lens])
    # Hybrid models: every fake request uses the padding state slot (garbage state is fine there).
    state_indices = torch.full((len(query_lens),), runner.num_state_slots, dtype=torch.int32, device=runner.device)
    ctx = runner.forward_context(metadata, kv_caches, state_indices, metadata.query_start_loc.cpu())
    hidden = runner.model(input_ids, positions, ctx)
    return runner.model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])


def sample_each_kind(runner, all_kinds: tuple[SamplingParams, ...] = SAMPLING_KINDS) -> None:
    """The sampler at every filter kind (each is its own kernel variant), all in one batch and alone."""
    vocab_size = runner.config.model.vocab_size
    logits = torch.randn(len(all_kinds), vocab_size, device=runner.device)
    for kinds in (all_kinds, all_kinds[1:2], all_kinds[2:3]):
        metadata = build_sampling_metadata(list(kinds), seeds=list(range(len(kinds))), positions=[1] * len(kinds),
                                           vocab_size=vocab_size, device=runner.device,
                                           output_token_ids=[[1]] * len(kinds), prompt_token_ids=[[2]] * len(kinds))
        runner.sampler.sample(logits[: len(kinds)], metadata)


def attention_shapes(runner) -> list[tuple[object, list[int], list[int]]]:
    """(layer, query_lens, seq_lens) of the attention calls whose kernel variants real steps will
    use (``AttentionBackend.warmup_shapes``), per distinct full-attention layer shape."""
    scheduler = runner.config.scheduler
    max_prefill_len = min(256, scheduler.max_num_batched_tokens - 1, scheduler.max_model_len)
    decode_batches = []
    if runner.use_graphs:
        from weir.runner.cuda_graphs import default_capture_sizes

        decode_batches = default_capture_sizes(scheduler.max_num_seqs)[::-1]  # captured largest first
    return [(layer, *shape) for layer in distinct_attention_layers(runner)
            for shape in runner.attn_backend.warmup_shapes(layer, max_prefill_len, decode_batches,
                                                           scheduler.max_model_len)]


@torch.inference_mode()
def attention_only(runner, scratch, layer, query_lens: list[int], seq_lens: list[int]) -> None:
    metadata = dummy_metadata(runner, query_lens, seq_lens)
    generator = torch.Generator(device=runner.device).manual_seed(0)
    q = torch.randn(metadata.num_tokens, layer.num_heads, layer.head_dim, device=runner.device,
                    dtype=runner.dtype, generator=generator)
    kv = torch.randn(2, metadata.num_tokens, layer.num_kv_heads, layer.head_dim, device=runner.device,
                     dtype=runner.dtype, generator=generator)
    runner.attn_backend.forward(layer, q, kv[0], kv[1], scratch[layer.layer_idx], metadata)


def distinct_attention_layers(runner) -> list:
    """One full-attention layer per distinct shape (most models have a single one)."""
    seen = {}
    for layer in runner.attn_layers:
        seen.setdefault((layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.kind), layer)
    return list(seen.values())


def compile_kernel_variants(runner, scratch) -> None:
    """Launch every kernel variant once (see the module docstring); returns when all finished.

    Two waves, so that no variant compiles twice at once: the first holds the tiny forward, the
    sampler and one decode batch (between them every kernel's first variant), the second the
    remaining attention shapes, each of which only adds its own tile or split variant."""
    start = time.perf_counter()
    tiny_forward = (dummy_forward, (runner, [1, 2], scratch))
    shapes = attention_shapes(runner)
    first_decode = next((shape for shape in shapes if max(shape[1]) == 1), None)
    first_wave = [(sample_each_kind, (runner,))]
    first_wave += [(attention_only, (runner, scratch, *first_decode))] if first_decode else []
    second_wave = [(attention_only, (runner, scratch, *shape)) for shape in shapes if shape is not first_decode]
    num_threads = max(1, min(MAX_WARMUP_THREADS, os.cpu_count() or 1, 1 + len(first_wave) + len(second_wave)))
    if runner.state_layers:
        run_task(runner.device, *tiny_forward)
    else:
        first_wave.insert(0, tiny_forward)
        if compile_ahead_safe(runner):
            # Every task but the sampler's logprobs kind (it indexes with sampled ids, which a
            # compile-only pass leaves unwritten), plus decode batches of 1, 2 and 16 rows: the
            # kernels that specialise on the token count (== 1, multiple of 16, other), and the
            # one-row GEMV, would otherwise compile one by one during the graph capture.
            decode_batches = [(dummy_forward, (runner, [1] * batch, scratch)) for batch in (1, 2, 16)]
            compile_ahead(runner, [tiny_forward, (sample_each_kind, (runner, SAMPLING_KINDS[:-1]))] + decode_batches
                          + [(attention_only, (runner, scratch, *shape)) for shape in shapes], num_threads)
    with ThreadPoolExecutor(num_threads, thread_name_prefix="weir-warmup") as pool:
        for wave in (first_wave, second_wave):
            for future in [pool.submit(run_task, runner.device, fn, args) for fn, args in wave]:
                future.result()  # re-raises a task's error here
    runner.platform.synchronize()
    logger.info("kernel variants compiled in %.1f s (%d attention shapes, %d threads)",
                time.perf_counter() - start, len(shapes), num_threads)


COMPILE_AHEAD_ENV = "WEIR_COMPILE_AHEAD"  # "0" turns the compile-ahead pass off


def compile_ahead_safe(runner) -> bool:
    """Whether a forward whose Triton kernels do not run is harmless for this model: only when
    no torch op indexes with a Triton kernel's output (MoE routing and linear-attention state
    kernels do) and every kernel compiles without autotuning (fla's would time no-ops)."""
    return (runner.device.type == "cuda" and not runner.state_layers and runner.moe_backend is None
            and os.environ.get(COMPILE_AHEAD_ENV, "1") != "0")


class _CompileOnly(threading.local):
    active = False


def compile_ahead(runner, tasks, num_threads: int) -> bool:
    """Run ``tasks`` in this thread with each Triton launch replaced by a compile-only warm-up
    (``KernelInterface.run(warmup=True)``) under Triton's ``AsyncCompileMode``: every variant
    compiles in a pool at once, none launches. Device buffers the kernels would have written
    keep whatever they held, which ``compile_ahead_safe`` makes harmless. Returns False (and
    the waves compile as they run) when this Triton lacks the machinery or a compile failed."""
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return False
    start = time.perf_counter()
    compile_only = _CompileOnly()
    launch = KernelInterface.__getitem__

    def launch_or_compile(kernel, grid):
        warmup = compile_only.active  # other threads (none should launch now) launch as usual
        return lambda *args, **kwargs: kernel.run(*args, grid=grid, warmup=warmup, **kwargs)

    KernelInterface.__getitem__ = launch_or_compile
    compile_only.active = True
    try:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="weir-compile") as pool:
            with _async_compile.AsyncCompileMode(pool):
                for fn, args in tasks:
                    fn(*args)
    except Exception as error:  # noqa: BLE001 - the waves compile again and report real errors
        _async_compile.active_mode.set(None)  # Triton leaves it set when a compile raised
        logger.warning("compile-ahead pass failed (%s: %s); compiling while warming up instead",
                       type(error).__name__, error)
        return False
    finally:
        compile_only.active = False
        KernelInterface.__getitem__ = launch
    runner.platform.synchronize()
    logger.info("compile-ahead: %d tasks' kernels compiled in %.1f s", len(tasks), time.perf_counter() - start)
    return True


def run_task(device: torch.device, fn, args) -> None:
    if device.type != "cuda":  # nothing to compile; CPU tests run the tasks for their shapes
        fn(*args)
        return
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        fn(*args)
    stream.synchronize()


def split_tokens(num_tokens: int, max_len: int, max_reqs: int) -> list[int]:
    """Query lengths of a dummy batch of ``num_tokens`` tokens: as few requests as fit."""
    num_reqs = min(max_reqs, max(1, math.ceil(num_tokens / max_len)))
    base, extra = divmod(num_tokens, num_reqs)
    return [min(max_len, base + (1 if i < extra else 0)) for i in range(num_reqs)]
