"""Compiling the kernel variants a server will launch, before the first request, in parallel.

A cold start spends most of its time in Triton's compiler, one variant at a time, as the
profiling run and the graph capture first launch each. The warm-up tasks here launch every
variant real steps will use: a tiny whole-model forward (every layer's kernels once), decode
batches of 1, 2 and 16 rows (kernels that specialise on the token count, the one-row GEMV), the
attention backend alone at each shape it names (``AttentionBackend.warmup_shapes``: prefill
tiles, decode split counts) and the sampler at each filter kind.

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

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from weir.attention import AttentionMetadata
from weir.sample import Sampler
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
        # A scratch sampler: the runner's keeps no rows (nor penalty state) for fake requests.
        num_rows = len(kinds)
        sampler = Sampler.for_params(list(kinds), seeds=list(range(num_rows)), vocab_size=vocab_size,
                                     device=runner.device, output_token_ids=[[1]] * num_rows,
                                     prompt_token_ids=[[2]] * num_rows)
        positions = torch.ones(num_rows, dtype=torch.int32, device=runner.device)  # int32, as a step's seq_lens
        sampler.sample(logits[:num_rows], torch.arange(num_rows, device=runner.device), np.arange(num_rows),
                       positions)


def attention_shapes(runner) -> list[tuple[object, list[int], list[int]]]:
    """(layer, query_lens, seq_lens) of the attention calls whose kernel variants real steps will
    use (``AttentionBackend.warmup_shapes``), per distinct full-attention layer shape."""
    scheduler = runner.config.scheduler
    max_prefill_len = min(256, scheduler.max_num_batched_tokens - 1, scheduler.max_model_len)
    decode_batches = runner.capture_sizes[::-1] if runner.use_graphs else []  # captured largest first
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


def compile_kernel_variants(runner, scratch) -> bool:
    """Launch every kernel variant once (see the module docstring); returns when all finished,
    True when they were compiled ahead (every variant a step uses is then loaded)."""
    start = time.perf_counter()
    shapes = attention_shapes(runner)
    forwards = [(dummy_forward, (runner, query_lens, scratch)) for query_lens in ([1, 2], [1], [1, 1], [1] * 16)]
    attention = [(attention_only, (runner, scratch, *shape)) for shape in shapes]
    # The sampler's logprobs kind indexes with sampled ids, which a compile-only pass leaves unwritten.
    compile_ahead_tasks = forwards + attention + [(sample_each_kind, (runner, SAMPLING_KINDS[:-1]))]
    ahead = compile_ahead_safe(runner) and compile_ahead(runner, compile_ahead_tasks)
    for fn, args in forwards + attention + [(sample_each_kind, (runner,))]:
        fn(*args)
    runner.platform.synchronize()
    logger.info("kernel variants %s in %.1f s (%d attention shapes)",
                "compiled ahead and launched" if ahead else "compiled and launched", time.perf_counter() - start,
                len(shapes))
    return ahead


COMPILE_AHEAD_ENV = "WEIR_COMPILE_AHEAD"  # "0" turns the compile-ahead pass off


def compile_ahead_safe(runner) -> bool:
    """Whether a forward whose Triton kernels do not run is harmless for this model: only when
    no torch op indexes with a Triton kernel's output (MoE routing and linear-attention state
    kernels do) and every kernel compiles without autotuning (fla's would time no-ops)."""
    return (runner.device.type == "cuda" and not runner.state_layers and runner.moe_backend is None
            and os.environ.get(COMPILE_AHEAD_ENV, "1") != "0")


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
