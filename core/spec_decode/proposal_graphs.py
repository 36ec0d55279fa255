"""CUDA graphs of a draft network's passes after a decode step that ran in a graph.

A step planned as a decode graph of ``size`` requests and ``width`` token slots each (every
request verifying at most ``width - 1`` drafts, padded with the table's padding row) leaves its
inputs in the runner's persistent buffers: ``idx_mapping[:size]``, ``query_start_loc[:size + 1]``
(padding requests own one token each), ``positions`` and, for draft heads, the hidden states in
the graph's output. When every request of it sampled, a proposer's passes (the first over the
step's tokens, then ``k - 1`` one-token passes) read nothing else but the request table, so they
are recorded once per shape, right after the step's own graph, and replayed after it. Eager, they
launch several hundred kernels per pass from Python: at small batches that costs several times
the GPU time of the passes.

They share the step graphs' pool: a proposer's graph always replays after its step's graph and
before the next step's. Padding requests' passes read and write only the null block (the padding
row's block tables); their drafts are dropped. The longest sequence is baked as
``max_model_len``, as in the step's graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from weir.spec_decode.ngram import write_drafts


def runs_in_a_graph(plan, sampled: np.ndarray) -> bool:
    """Whether this step's proposals take the graph path: a decode-graph plan (eagerly in "warm"
    mode, recorded in "capture", replayed in "auto") in which every request sampled."""
    return plan.graph_size is not None and plan.graph_tokens is None and len(sampled) == plan.num_reqs


def write_graph_proposals(runner, table, rows: torch.Tensor, plan, graph_mode: str,
                          passes: Callable[[int, int], torch.Tensor]) -> None:
    """Drafts ``[size, k]`` of a graph-planned step, written for its real requests ``rows``:
    ``passes(size, width)`` run eagerly ("warm", or no graph of this shape), recorded then
    replayed ("capture"), or replayed ("auto")."""
    size, width = plan.graph_size, plan.graph_width
    graphs = runner.graphs
    key = ("proposer", size, width)
    drafts = None
    if graphs is not None and graph_mode not in ("warm", "off"):
        if graph_mode == "capture":
            graphs.capture_named(key, lambda: passes(size, width))
        drafts = graphs.replay_named(key)
    if drafts is None:
        drafts = passes(size, width)
    write_drafts(table, rows, drafts[: plan.num_reqs], torch.full_like(rows, drafts.shape[1]))


def step_layout(runner, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The graph step's ``rows [size]`` (padding row after the real ones), ``query_start_loc
    [size + 1]`` int32 and each request's first position ``starts [size]`` int64, read from the
    runner's persistent buffers on the device."""
    buffers = runner.inputs
    rows = buffers.idx_mapping[:size]
    query_start_loc = buffers.query_start_loc[: size + 1]
    starts = buffers.positions[query_start_loc[:size].long()]
    return rows, query_start_loc, starts


def per_row(table, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values [n]`` by table row ([R], zero elsewhere): what the input-prep kernel reads as each
    row's first position. Padding requests share one row, and write equal values to it."""
    like = table.num_computed_tokens.gpu
    return torch.zeros_like(like).index_copy_(0, rows, values.to(like.dtype))


def one_token_passes(caches, rows: torch.Tensor, position_before: torch.Tensor, num_speculative_tokens: int,
                     max_model_len: int) -> Iterator[tuple[int, torch.Tensor, object]]:
    """The ``k - 1`` one-token passes after the first, over the padded batch ``rows [P]``: for
    each ``step``, the position each request's pass runs at (``position_before + step``; padding
    rows, which know no token, clamped to 0) clamped inside ``max_model_len``, and its context
    (``caches``: the proposer's ``DraftCaches``)."""
    one_each = torch.arange(rows.shape[0] + 1, dtype=torch.int32, device=rows.device)  # one token per request
    for step in range(1, num_speculative_tokens):
        position = (position_before + step).clamp_min(0)  # [P]
        ctx = caches.device_context(rows, one_each, position, position + 1, 1, max_model_len, has_unowned_tokens=False)
        yield step, position.clamp_max(max_model_len - 1), ctx
