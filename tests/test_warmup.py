"""The start-up warm-up's tasks (``weir.runner.warmup``): on the CPU they compile nothing, but
every shape they launch must be one the backends accept, for dense and hybrid models."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from helpers_models import make_tiny_qwen3_next
from weir import LLM
from weir.runner.cuda_graphs import default_capture_sizes
from weir.runner.warmup import (
    COMPILE_AHEAD_ENV, attention_shapes, compile_ahead, compile_ahead_safe, compile_kernel_variants,
)


def test_tasks_cover_prefill_classes_and_every_graph_batch(tiny_llm, caplog):
    runner = tiny_llm.engine.runner
    runner.use_graphs = True  # as on CUDA: the decode batches of every captured size
    runner.capture_sizes = default_capture_sizes(runner.config.scheduler.max_num_seqs)
    try:
        shapes = attention_shapes(runner)  # the torch backend: the generic shapes, every one, once
        assert len(shapes) == len({repr(shape) for shape in shapes})
        prefill_lens = [query_lens[1] for query_lens, _ in shapes if max(query_lens) > 1]
        assert prefill_lens == [2, 4, 8, 16, 32, 64, 128, 256]
        decode_batches = [len(query_lens) for query_lens, _ in shapes if max(query_lens) == 1]
        assert decode_batches[-4:] == [8, 4, 2, 1] and decode_batches[0] == runner.config.scheduler.max_num_seqs
        assert all(seq_lens == [runner.config.scheduler.max_model_len] * len(seq_lens)
                   for query_lens, seq_lens in shapes if max(query_lens) == 1)
        with caplog.at_level(logging.INFO, logger="weir.runner.warmup"):
            compile_kernel_variants(runner)
        assert "kernel variants compiled" in caplog.text
        assert runner.table.row_of == {}  # every dummy step gave its rows back
    finally:
        runner.use_graphs, runner.capture_sizes = False, []


def test_a_dummy_step_runs_the_real_step_on_the_null_block_and_gives_its_rows_back(tiny_llm):
    runner = tiny_llm.engine.runner
    handle = runner.dummy_run([1, 3], context_lens=[6, 0])
    assert handle.get().req_ids == ["weir-dummy-0", "weir-dummy-1"]
    buffers = runner.inputs  # what the step's input kernels wrote
    assert buffers.query_start_loc[:3].tolist() == [0, 1, 4] and buffers.seq_lens[:2].tolist() == [7, 3]
    assert buffers.positions[:4].tolist() == [6, 0, 1, 2]
    assert buffers.block_tables.shape[-1] == runner.max_blocks_per_req
    assert buffers.block_tables[:, :2].eq(0).all()  # every block the null block
    assert buffers.slot_mappings[0, :4].tolist() == [6 % runner.block_size, 0, 1, 2]
    assert runner.table.row_of == {} and tiny_llm.engine.scheduler.kv_cache.usage() == 0


def test_hybrid_model_and_a_short_max_model_len(tmp_path, caplog):
    llm = LLM(str(make_tiny_qwen3_next(tmp_path)), device="cpu", dtype="float32", max_model_len=64,
              max_num_seqs=4)
    runner = llm.engine.runner
    prefill_lens = [query_lens[1] for query_lens, _ in attention_shapes(runner)]
    assert prefill_lens == [2, 4, 8, 16, 32, 64]  # none longer than a request can be
    with caplog.at_level(logging.INFO, logger="weir.runner.warmup"):
        compile_kernel_variants(runner)
    assert "kernel variants compiled" in caplog.text


def test_triton_backend_keeps_one_shape_per_kernel_variant():
    from weir.attention import AttentionLayerSpec
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    backend = TritonAttentionBackend(16, torch.bfloat16, torch.device("cpu"))  # 8 "SMs" off the GPU
    layer = AttentionLayerSpec(layer_idx=0, num_heads=16, num_kv_heads=8, head_dim=128, scale=1.0)
    generic = super(TritonAttentionBackend, backend).warmup_shapes(layer, 256, [64, 32, 16, 8, 4, 2, 1], 4096)
    kept = backend.warmup_shapes(layer, 256, [64, 32, 16, 8, 4, 2, 1], 4096)
    assert len(kept) < len(generic) and all(shape in generic for shape in kept)
    prefill_tiles = {backend_tiles(backend, layer, q) for q, _ in generic if max(q) > 1}
    assert len([q for q, _ in kept if max(q) > 1]) == len(prefill_tiles)
    split_classes = {split_class(backend, layer, len(q)) for q, _ in generic if max(q) == 1}
    assert sorted(split_class(backend, layer, len(q)) for q, _ in kept if max(q) == 1) == sorted(split_classes)


def backend_tiles(backend, layer, query_lens):
    from weir.plugins.attention.triton_paged import default_prefill_tiles

    return default_prefill_tiles(layer.head_dim, max(query_lens), 2, backend.dtype)


def split_class(backend, layer, batch):
    splits = backend.num_kv_splits(batch, layer.num_kv_heads, 4096)
    return 1 if splits == 1 else 1 << (splits - 1).bit_length()


class _RecordingKernel:
    """Stands in for a Triton kernel: records whether each launch was a compile-only warm-up."""

    def __init__(self):
        from triton.runtime.jit import KernelInterface

        class Kernel(KernelInterface):
            def run(kernel, *args, grid, warmup, **kwargs):
                self.calls.append((threading.current_thread().name, warmup))

        self.calls = []
        self.kernel = Kernel()


def test_compile_ahead_turns_only_this_threads_launches_into_warmups():
    pytest.importorskip("triton.runtime._async_compile")
    from triton.runtime import _async_compile
    from triton.runtime.jit import KernelInterface

    recording = _RecordingKernel()
    runner = SimpleNamespace(platform=SimpleNamespace(synchronize=lambda: None))
    getitem = KernelInterface.__getitem__

    def task():
        recording.kernel[(1,)](1, 2)
        other = threading.Thread(target=lambda: recording.kernel[(1,)](3), name="bystander")
        other.start()
        other.join()

    assert compile_ahead(runner, [(task, ())], num_threads=2)
    recording.kernel[(1,)](4)  # after the pass: launches again
    assert recording.calls == [("MainThread", True), ("bystander", False), ("MainThread", False)]
    assert KernelInterface.__getitem__ is getitem and _async_compile.active_mode.get() is None


def test_compile_ahead_failure_restores_launches_and_reports(caplog):
    pytest.importorskip("triton.runtime._async_compile")
    from triton.runtime import _async_compile
    from triton.runtime.jit import KernelInterface

    getitem = KernelInterface.__getitem__
    runner = SimpleNamespace(platform=SimpleNamespace(synchronize=lambda: None))

    def broken_task():
        raise RuntimeError("no such kernel")

    with caplog.at_level(logging.WARNING, logger="weir.runner.warmup"):
        assert not compile_ahead(runner, [(broken_task, ())], num_threads=2)
    assert "compile-ahead pass failed (RuntimeError: no such kernel)" in caplog.text
    assert KernelInterface.__getitem__ is getitem and _async_compile.active_mode.get() is None


def test_compile_ahead_is_for_dense_cuda_models_only(tiny_llm, monkeypatch):
    runner = tiny_llm.engine.runner
    assert not compile_ahead_safe(runner)  # the CPU: nothing compiles
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    assert compile_ahead_safe(runner)
    monkeypatch.setenv(COMPILE_AHEAD_ENV, "0")
    assert not compile_ahead_safe(runner)


def test_graph_pool_estimate_counts_each_smaller_graphs_logits_as_the_allocator_rounds_them():
    from weir.runner.cuda_graphs import graph_pool_bytes_estimate

    mib = 2**20
    # The largest graph's logits are in its decode peak already; a 1 MiB block stays 1 MiB, blocks
    # over 1 MiB round up to 2 MiB multiples (3 MiB -> 4 MiB).
    assert graph_pool_bytes_estimate(100 * mib, [1, 3, 8], mib) == 100 * mib + mib + 4 * mib
    assert graph_pool_bytes_estimate(7, [16], mib) == 7
    assert graph_pool_bytes_estimate(0, [], mib) == 0


def test_verify_warmups_run_the_verify_graphs_plan_where_graphs_are_on(tiny_llama_path):
    """Under speculation the warm-up's verify steps take the graphs' own plan ("warm"), which
    zeroes the rows of tokens past the last request: that kernel then loads before any capture,
    not inside one. Without graphs they run eagerly ("off")."""
    from weir.runner.warmup import warmup_tasks

    llm = LLM(str(tiny_llama_path), device="cpu", dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    runner = llm.engine.runner

    def verify_modes():
        return {args[3] for _, args in warmup_tasks(runner) if len(args) > 4}

    assert verify_modes() == {"off"}
    runner.use_graphs = True
    try:
        assert verify_modes() == {"warm"}
        for fn, args in warmup_tasks(runner):  # the graph plan's eager run works on any device
            if len(args) > 4:
                fn(*args)
        assert runner.table.row_of == {}
    finally:
        runner.use_graphs = False
