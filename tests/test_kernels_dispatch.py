"""Which version each input-preparation op runs, and that the GPU ones never synchronise."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from test_kernels_input_prep import random_batch
from weir.buffers import staged_write
from weir.kernels import dispatch, kv_store
from weir.runner import inputs


def test_cpu_tensors_never_reach_the_kernels(monkeypatch):
    def fail(*args):
        raise AssertionError("a CPU tensor was dispatched to Triton")

    monkeypatch.setattr(inputs, "_kernels", fail)
    monkeypatch.setattr(staged_write, "triton_module", fail)
    monkeypatch.setattr(kv_store, "triton_module", fail)
    *batch, num_tokens = random_batch(0, 3, 4, 16)
    input_ids, positions, _ = inputs.prepare_step_inputs(*batch, num_tokens)
    tables = inputs.gather_block_tables(torch.zeros(20, 4, dtype=torch.int32), batch[2])
    inputs.compute_slot_mapping(tables, batch[3], positions, 4)
    staged_write.scatter_flat(torch.zeros(4), torch.tensor([1]), torch.tensor([2.0]))
    kv_store.store_kv(torch.zeros(2, 2, 2, 1, 4), torch.ones(1, 1, 4), torch.ones(1, 1, 4), torch.tensor([1]))
    assert torch.equal(input_ids, inputs.prepare_step_inputs_torch(*batch, num_tokens)[0])
    assert not dispatch.use_triton(torch.zeros(1, device="meta"))


def test_the_disable_switch_is_read_once_until_reread(monkeypatch):
    """WEIR_DISABLE_TRITON is read at the first op, not per op; reread_triton_switch and
    forced_torch_ops make a change count, and forced_torch_ops undoes its own."""
    monkeypatch.setenv(dispatch.DISABLE_ENV, "1")
    dispatch.reread_triton_switch()
    try:
        assert dispatch.triton_enabled() is False
        monkeypatch.setenv(dispatch.DISABLE_ENV, "0")
        assert dispatch.triton_enabled() is False  # still the value read first
        dispatch.reread_triton_switch()
        assert dispatch.triton_enabled() is dispatch.triton_importable()
        with dispatch.forced_torch_ops():
            assert dispatch.triton_enabled() is False
        assert dispatch.triton_enabled() is dispatch.triton_importable()
        assert os.environ[dispatch.DISABLE_ENV] == "0"
    finally:
        monkeypatch.undo()
        dispatch.reread_triton_switch()  # later tests see the environment as it was


class Recorder:
    """Stands in for a kernel module: records which ``*_triton`` functions ran, then runs them."""

    def __init__(self, module):
        self.module = module
        self.called: set[str] = set()

    def __getattr__(self, name):
        self.called.add(name)
        return getattr(self.module, name)


def run_step_ops(device):
    """Every op of one step, on tensors built beforehand; returns the results on the CPU."""
    token_ids, num_computed, idx_mapping, qsl, num_tokens = random_batch(3, 6, 9, 64, 2, 3, 0, device=device)
    num_rows, max_model_len = token_ids.shape
    block_size = 4
    block_table = torch.arange(num_rows * 16, dtype=torch.int32, device=device).view(num_rows, 16) + 1
    num_tokens_known = (num_computed + 5).clamp_max(max_model_len)
    counts = torch.zeros(num_rows, 50_000, dtype=torch.int32, device=device)
    sampled = torch.arange(idx_mapping.shape[0], device=device) + 7
    cache = torch.zeros(2, 2000, block_size, 2, 8, dtype=torch.bfloat16, device=device)
    qkv = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    flat_index = torch.tensor([3, 70], device=device)
    values = torch.tensor([1500, 1501], dtype=torch.int32, device=device)  # distinct block ids
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any implicit synchronisation raises
    try:
        staged_write.scatter_flat(block_table, flat_index, values)
        input_ids, positions, seq_lens = inputs.prepare_step_inputs(token_ids, num_computed, idx_mapping, qsl,
                                                                    num_tokens)
        tables = inputs.gather_block_tables(block_table, idx_mapping)
        slots = inputs.compute_slot_mapping(tables, qsl, positions, block_size)
        # One cache group: the fused op takes [G, R, max_blocks] and returns [G, ...].
        fused_tables, fused_slots = inputs.gather_block_tables_and_slot_mapping(
            block_table[None], idx_mapping, qsl, positions, block_size)
        inputs.post_update(token_ids, num_tokens_known, num_computed, counts, idx_mapping, qsl[1:] - qsl[:-1],
                           sampled)
        kv_store.store_kv(cache, qkv[:, 16:32].view(-1, 2, 8), qkv[:, 32:].view(-1, 2, 8), fused_slots[0])
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    results = [block_table, input_ids, positions, seq_lens, tables, slots, fused_tables, fused_slots, token_ids,
               num_tokens_known, num_computed, counts, cache, qkv]
    return [r.cpu() for r in results]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("disable_triton", [False, True], ids=["triton", "torch"])
def test_step_ops_on_cuda_never_synchronise_and_match_the_cpu(monkeypatch, disable_triton):
    recorders = {name: Recorder(importlib.import_module(f"weir.kernels.{name}"))
                 for name in ("triton_input_prep", "triton_kv_store")}
    monkeypatch.setattr(inputs, "_kernels", lambda: recorders["triton_input_prep"])
    monkeypatch.setattr(staged_write, "triton_module", recorders.__getitem__)
    monkeypatch.setattr(kv_store, "triton_module", recorders.__getitem__)
    with dispatch.forced_torch_ops(disable_triton):
        cuda_results = run_step_ops(torch.device("cuda"))
        cpu_results = run_step_ops(torch.device("cpu"))
    if disable_triton:
        assert not recorders["triton_input_prep"].called and not recorders["triton_kv_store"].called
    else:
        assert len(recorders["triton_input_prep"].called) == 6 and recorders["triton_kv_store"].called
    # The random inputs are built on the CPU in both runs, so the results must agree exactly,
    # except where the kernels skip padding (slot -1) that torch writes to the null slot.
    for cuda_result, cpu_result in zip(cuda_results[:-2], cpu_results[:-2]):
        assert torch.equal(cuda_result, cpu_result)
    real_slots = cpu_results[7][0][cpu_results[7][0] >= 0]
    assert torch.equal(cuda_results[-2].view(2, -1, 2, 8)[:, real_slots],
                       cpu_results[-2].view(2, -1, 2, 8)[:, real_slots])


def test_step_ops_on_the_cpu_fuse_what_they_compute_apart():
    """The CPU run of the same ops (what the GPU test compares against): the fused table gather
    and slot mapping of one cache group equal the separate ops, and the KV store writes the real slots."""
    (block_table, _, _, _, tables, slots, fused_tables, fused_slots, *_rest, cache, qkv) = run_step_ops(
        torch.device("cpu"))
    assert fused_tables.shape[0] == 1 and torch.equal(fused_tables[0], tables)
    assert torch.equal(fused_slots[0], slots)
    real = slots >= 0
    assert real.any() and not real.all()  # the batch has padding
    stored_k = cache.view(2, -1, 2, 8)[0, slots[real]]  # [real tokens, Hkv, D]
    assert torch.equal(stored_k, qkv[real, 16:32].view(-1, 2, 8))
