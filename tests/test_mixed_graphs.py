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
from weir.runner.cuda_graphs import (MIXED_BATCH_SIZES, MIXED_TOKEN_SIZES, CudaGraphs, mixed_capture_lens,
                                     mixed_graph_shapes)
from weir.runner.input_buffers import plan_step
from weir.scheduler.output import CachedRequestData, SchedulerOutput


def test_shapes_hold_more_tokens_than_requests_largest_first():
    shapes = mixed_graph_shapes(16384, 1024, 4096)
    assert shapes[0] == (2048, 128) and shapes == sorted(shapes, reverse=True)
    assert all(tokens > batch for tokens, batch in shapes)
    assert {batch for _, batch in shapes} == set(MIXED_BATCH_SIZES)
    assert len(shapes) == 2 * len(MIXED_TOKEN_SIZES) - 2  # 64 or 128 tokens hold no mixed step of 128
    # The token budget and the running requests cap them.
    assert mixed_graph_shapes(128, 1024, 4096) == [(128, 32), (64, 32)]
    assert mixed_graph_shapes(300, 8, 4096) == [(256, 8), (128, 8), (64, 8)]
    assert mixed_graph_shapes(32, 1024, 4096) == []


@pytest.mark.parametrize("max_running_reqs,max_model_len", [(1, 1024), (4, 256), (8, 128), (1024, 48), (1, 1)])
def test_shapes_hold_no_more_tokens_than_their_requests_can(max_running_reqs, max_model_len):
    """A short context or few sequences bound the shapes (no step has more tokens), and each one
    can be made into a fake step to capture."""
    shapes = mixed_graph_shapes(16384, max_running_reqs, max_model_len)
    assert all(tokens <= batch * max_model_len for tokens, batch in shapes)
    for num_tokens, batch in shapes:
        lens = mixed_capture_lens(num_tokens, batch, max_model_len)
        assert len(lens) == batch and sum(lens) == num_tokens


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
    assert plan.has_unowned_tokens  # tokens 32..63: attention zeroes their rows


def test_only_padded_graph_steps_have_tokens_owned_by_no_request():
    """Attention writes zeros to the rows of tokens past the last request only where a step
    can have them: a mixed-step graph, or a speculative-width graph; a width-1 decode graph's
    padding requests own one token each, and an eager step has only real tokens."""
    no_graph = lambda num_reqs, max_query_len: None  # noqa: E731
    eager = plan_step(step({"a": 1, "b": 30}), Table(), no_graph, 64, lambda num_reqs, num_tokens: None)
    decode = plan_step(step({"a": 1, "b": 1}), Table(), lambda num_reqs, max_query_len: (4, 1), 64)
    width = plan_step(step({"a": 3, "b": 1}), Table(), lambda num_reqs, max_query_len: (4, 3), 64)
    mixed = plan_step(step({"a": 1, "b": 30}), Table(), no_graph, 64, lambda num_reqs, num_tokens: (64, 5))
    assert [p.has_unowned_tokens for p in (eager, decode, width, mixed)] == [False, False, True, True]
    assert width.num_tokens == 12 and width.query_start_loc[-1] == 6  # tokens 6..11 belong to none


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


def test_warm_runs_plan_the_capture_s_step():
    """The eager run before a capture takes the capture's plan (its baked longest query picks the
    kernels' tile variants), not the step's own: here 30 decodes and two chunks of 49 tokens that
    the capture plans as one shape holding a 97-token query."""
    from weir.runner.model_runner import ModelRunner

    class Runner:  # what ModelRunner._plan reads
        graph_widths, mixed_graph_shapes, graphs, max_model_len = [1], [(128, 32)], None, 64

        class caches:
            state_layers = ()

        class table:
            row_of = {f"r{i}": i for i in range(32)}
            num_computed_host = np.zeros(33, dtype=np.int64)
            padding_row = 32

    lens = mixed_capture_lens(128, 32, 64)
    out = step({f"r{i}": n for i, n in enumerate(lens)})
    warm, capture, off = (ModelRunner._plan(Runner, out, mode) for mode in ("warm", "capture", "off"))
    assert warm.graph_tokens == capture.graph_tokens == 128 and warm.max_query_len == capture.max_query_len == 97
    assert off.graph_size is None and off.max_query_len == 49


def test_mixed_graphs_share_the_first_ones_logits():
    graphs = CudaGraphs(torch.device("cpu"), [])
    largest = torch.randn(8, 5)
    assert graphs._share_mixed_output(largest) is largest
    smaller = torch.randn(3, 5)
    rows = graphs._share_mixed_output(smaller)
    assert rows.data_ptr() == largest.data_ptr() and torch.equal(rows, smaller) and rows.shape == (3, 5)
    with pytest.raises(RuntimeError, match="capture the largest batch first"):
        graphs._share_mixed_output(torch.randn(9, 5))


def test_cudagraph_mode_takes_vllms_names_and_refuses_others(tmp_path):
    assert EngineArgs(cudagraph_mode="FULL_DECODE_ONLY")._validate() is None
    with pytest.raises(ValueError, match="cudagraph_mode must be one of full, full_decode_only, none .* got 'piecewise'"):
        EngineArgs(cudagraph_mode="piecewise")._validate()
    path = make_tiny_qwen3(tmp_path)
    config = EngineArgs(model=str(path), cudagraph_mode="FULL_AND_PIECEWISE", max_model_len=128).create_config()
    assert config.cudagraph_mode == "full"  # vLLM's default: Weir's full graphs cover its piecewise ones


def test_cudagraph_mode_reaches_the_runner(tmp_path):
    path = make_tiny_qwen3(tmp_path)
    llm = LLM(str(path), cudagraph_mode="FULL_DECODE_ONLY", max_model_len=128)
    assert llm.engine.config.cudagraph_mode == "full_decode_only"
    assert llm.engine.runner.mixed_graph_shapes == [] and llm.engine.runner.graphs is None  # no graphs on the CPU
