"""Mixed-step CUDA graphs on the host side: which shapes are captured, how a step is padded to
one, the fake steps that capture them, and the option that turns them off. (Replays, their
parity with transformers and the absence of syncs are GPU tests: test_gpu_engine.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers_models import make_tiny_qwen3
from weir import LLM
from weir.config import EngineArgs
from weir.runner.cuda_graphs import (MIXED_BATCH_SIZES, MIXED_TOKEN_SIZES, CudaGraphs, graph_pool_bytes_estimate,
                                     mixed_capture_lens, mixed_graph_shapes)
from weir.runner.input_buffers import plan_step
from weir.scheduler.output import CachedRequestData, SchedulerOutput


def test_shapes_hold_more_tokens_than_requests_largest_first():
    shapes = mixed_graph_shapes(16384, 1024)
    assert shapes[0] == (2048, 128) and shapes == sorted(shapes, reverse=True)
    assert all(tokens > batch for tokens, batch in shapes)
    assert {batch for _, batch in shapes} == set(MIXED_BATCH_SIZES)
    assert len(shapes) == 2 * len(MIXED_TOKEN_SIZES) - 2  # 64 or 128 tokens hold no mixed step of 128
    # The token budget and the running requests cap them.
    assert mixed_graph_shapes(128, 1024) == [(128, 32), (64, 32)]
    assert mixed_graph_shapes(300, 8) == [(256, 8), (128, 8), (64, 8)]
    assert mixed_graph_shapes(32, 1024) == []


@pytest.mark.parametrize("num_tokens,batch,max_len", [(64, 32, 4096), (2048, 128, 4096), (2048, 32, 256),
                                                      (33, 32, 2), (1024, 1, 1024)])
def test_capture_lens_make_one_mixed_step_of_the_shape(num_tokens, batch, max_len):
    lens = mixed_capture_lens(num_tokens, batch, max_len)
    assert len(lens) == batch and sum(lens) == num_tokens
    assert max(lens) >= 2 and max(lens) <= max_len


def test_capture_lens_refuse_a_shape_no_batch_can_hold():
    with pytest.raises(ValueError, match="cannot hold 100 tokens"):
        mixed_capture_lens(100, 4, 16)


def test_a_step_takes_the_smallest_graph_that_holds_it():
    graphs = CudaGraphs(torch.device("cpu"), [])
    graphs._mixed = {32: [64, 128, 256], 128: [256, 512]}  # what capture() records
    assert graphs.padded_mixed(3, 40) == (64, 32)
    assert graphs.padded_mixed(32, 64) == (64, 32)  # padding requests own no token: no room needed
    assert graphs.padded_mixed(33, 64) == (256, 128)
    assert graphs.padded_mixed(10, 300) == (512, 128)  # too many tokens for the 32-request graphs
    assert graphs.padded_mixed(129, 200) is None and graphs.padded_mixed(5, 600) is None
    assert CudaGraphs.key(32, num_tokens=64) != CudaGraphs.key(32) != CudaGraphs.key(32, width=2)


class Table:
    row_of = {"a": 3, "b": 5, "c": 0}
    num_computed_host = np.array([7, 0, 0, 9, 0, 4, 0, 0, 0], dtype=np.int64)
    padding_row = 8


def step(num_scheduled_tokens: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(new_reqs=[], cached_reqs=CachedRequestData(), num_scheduled_tokens=num_scheduled_tokens,
                           total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
                           sampling_req_ids=set(num_scheduled_tokens), min_tokens_req_ids=set(),
                           finished_req_ids=set(), preempted_req_ids=set())


def test_plan_pads_a_mixed_step_with_requests_that_own_no_token():
    asked = []

    def mixed_graph(num_reqs, num_tokens):
        asked.append((num_reqs, num_tokens))
        return 64, 5

    plan = plan_step(step({"a": 1, "b": 30, "c": 1}), Table(), lambda num_reqs, max_query_len: None, 64, mixed_graph)
    assert asked == [(3, 32)]
    assert plan.padded_rows.tolist() == [3, 5, 0, 8, 8]
    assert plan.query_start_loc.tolist() == [0, 1, 31, 32, 32, 32]
    assert plan.num_tokens == 64 and plan.graph_tokens == 64 and plan.graph_size == 5 and plan.batch == 5
    # Baked into the graph's launches: the longest query the padded step holds, and any length.
    assert plan.max_query_len == 60 and plan.max_seq_len == 64
    assert plan.num_reqs == 3 and plan.query_lens.tolist() == [1, 30, 1]


def test_plan_asks_for_a_mixed_graph_only_when_no_decode_graph_serves_the_step():
    asked = []

    def mixed_graph(num_reqs, num_tokens):
        asked.append(num_tokens)
        return None

    decode = plan_step(step({"a": 1, "b": 1}), Table(), lambda num_reqs, max_query_len: (4, 1), 64, mixed_graph)
    assert asked == [] and decode.graph_size == 4 and decode.graph_tokens is None
    assert decode.query_start_loc.tolist() == [0, 1, 2, 3, 4]  # decode padding owns one token each
    eager = plan_step(step({"a": 1, "b": 30}), Table(), lambda num_reqs, max_query_len: None, 64, mixed_graph)
    assert asked == [31] and eager.graph_size is None and eager.num_tokens == 31 and eager.max_query_len == 30
    ungraphed_decode = plan_step(step({"a": 1}), Table(), lambda num_reqs, max_query_len: None, 64, mixed_graph)
    assert asked == [31] and ungraphed_decode.graph_size is None  # decode steps never take a mixed graph


def test_pool_estimate_counts_one_shared_mixed_logits_buffer():
    mib = 2**20
    # The peak came from the largest mixed shape's run (its logits in it), or from the largest decode batch.
    assert graph_pool_bytes_estimate(100 * mib, [1, 8], mib, [32, 32, 128], peak_batch=128) == 109 * mib
    assert graph_pool_bytes_estimate(100 * mib, [1, 8], mib, [32, 32, 128]) == 229 * mib
    assert graph_pool_bytes_estimate(100 * mib, [1, 8], mib) == 101 * mib


def test_mixed_graphs_share_the_first_ones_logits():
    graphs = CudaGraphs(torch.device("cpu"), [])
    largest = torch.randn(8, 5)
    assert graphs._share_mixed_output(largest) is largest
    smaller = torch.randn(3, 5)
    rows = graphs._share_mixed_output(smaller)
    assert rows.data_ptr() == largest.data_ptr() and torch.equal(rows, smaller) and rows.shape == (3, 5)
    with pytest.raises(RuntimeError, match="capture the largest batch first"):
        graphs._share_mixed_output(torch.randn(9, 5))


def test_cudagraph_mode_takes_vllms_names_and_refuses_others():
    assert EngineArgs(cudagraph_mode="FULL_DECODE_ONLY")._validate() is None
    with pytest.raises(ValueError, match="cudagraph_mode must be one of full, full_decode_only, none, got 'piecewise'"):
        EngineArgs(cudagraph_mode="piecewise")._validate()


def test_cudagraph_mode_reaches_the_runner(tmp_path):
    path = make_tiny_qwen3(tmp_path)
    llm = LLM(str(path), cudagraph_mode="FULL_DECODE_ONLY", max_model_len=128)
    assert llm.engine.config.cudagraph_mode == "full_decode_only"
    assert llm.engine.runner.mixed_graph_shapes == [] and llm.engine.runner.graphs is None  # no graphs on the CPU
