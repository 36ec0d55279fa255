"""One step's plan on the host, and its inputs in persistent device buffers.

The host copies ``idx_mapping`` and ``query_start_loc`` in; the input-prep kernels
(``weir.runner.inputs``) write ids, positions, lengths, every group's block tables and slot
mappings and the state slots beside them. An eager forward reads slices of these buffers; a CUDA
graph was captured reading the same buffers, so a replay needs no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from weir.runner.request_table import RequestTable
from weir.scheduler.output import SchedulerOutput


@dataclass
class StepPlan:
    """What the host decided about one step, before anything reaches the device."""

    req_ids: list[str]  # batch order
    rows: np.ndarray  # [num_reqs] request-table rows
    query_lens: np.ndarray  # [num_reqs] tokens scheduled per request
    padded_rows: np.ndarray  # [batch] rows, the padding row after the real ones
    query_start_loc: np.ndarray  # [batch + 1] int32; decode-graph padding requests own one token each
    num_tokens: int
    max_query_len: int
    max_seq_len: int  # max_model_len for graph batches: a graph must serve any length
    graph_size: int | None  # the CUDA graph this step replays or captures, if any
    num_drafts: np.ndarray | None = None  # [num_reqs] drafts each request verifies (speculative decoding)
    # Device token index of every logits row (speculative decoding: a verifying request's every
    # token); None: each request's last token.
    logits_indices: torch.Tensor | None = None
    graph_width: int = 1  # token slots per request of the graph (1 + drafts under speculation)
    graph_tokens: int | None = None  # a mixed-step graph's token count (None: a decode graph, or eager)

    @property
    def has_drafts(self) -> bool:
        return self.num_drafts is not None and bool(self.num_drafts.any())

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def has_unowned_tokens(self) -> bool:
        """Whether tokens past the last request may belong to none: a mixed-step graph's
        padding, or a speculative-width graph's slots past its last request."""
        return self.graph_size is not None and (self.graph_tokens is not None or self.graph_width > 1)

    @property
    def batch(self) -> int:
        return len(self.padded_rows)


def plan_step(out: SchedulerOutput, table: RequestTable, graph_size: Callable[[int, int], tuple[int, int] | None],
              max_model_len: int,
              mixed_graph: Callable[[int, int], tuple[int, int] | None] | None = None) -> StepPlan:
    """Batch order, rows and lengths of one step; ``graph_size(num_reqs, max_query_len)`` is the
    CUDA graph (size, width) a batch of that many requests runs in (None: eager), and for the
    other batches ``mixed_graph(num_reqs, num_tokens)`` the mixed-step graph (num_tokens, size)
    (None: eager). A graph batch is padded with the table's padding row; a padding request owns
    one token in a decode graph and none in a mixed-step one. A graph of width ``w`` runs
    ``size * w`` tokens, a mixed-step graph its token count, those past the last request
    belonging to none."""
    req_ids = list(out.num_scheduled_tokens)  # batch order
    num_reqs = len(req_ids)
    rows = np.array([table.row_of[req_id] for req_id in req_ids], dtype=np.int64)
    query_lens = np.array([out.num_scheduled_tokens[req_id] for req_id in req_ids], dtype=np.int64)
    max_query_len = int(query_lens.max())
    max_seq_len = int((table.num_computed_host[rows] + query_lens).max())
    num_drafts = np.array([out.num_draft_tokens.get(req_id, 0) for req_id in req_ids], dtype=np.int64)
    graph = graph_size(num_reqs, max_query_len)
    size, width = graph if graph is not None else (None, 1)
    graph_tokens = None
    if size is None and mixed_graph is not None and max_query_len > 1:
        graph_tokens, size = mixed_graph(num_reqs, int(query_lens.sum())) or (None, None)
    if size is not None:
        max_seq_len = max_model_len  # baked into the graph's launches: any length must fit
        # Baked too: the longest query the padded step can hold (a mixed graph's tile shapes).
        max_query_len = width if graph_tokens is None else graph_tokens - size + 1
    padded_rows = np.full(size or num_reqs, table.padding_row, dtype=np.int64)
    padded_rows[:num_reqs] = rows
    query_start_loc = np.arange(len(padded_rows) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1: num_reqs + 1])
    if graph_tokens is None:
        query_start_loc[num_reqs + 1:] += query_start_loc[num_reqs] - num_reqs
    else:  # a mixed step's padding requests own no token: the graph's token count is the real bound
        query_start_loc[num_reqs + 1:] = query_start_loc[num_reqs]
    num_tokens = graph_tokens or (int(query_start_loc[-1]) if width == 1 else size * width)
    return StepPlan(req_ids, rows, query_lens, padded_rows, query_start_loc, num_tokens,
                    max_query_len, max_seq_len, size, num_drafts, graph_width=width, graph_tokens=graph_tokens)


class InputBuffers:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, num_groups: int, max_blocks_per_req: int,
                 device: torch.device, pin_memory: bool, has_state: bool):
        """Room for a batch of ``max_num_reqs`` requests (padding included) and ``max_num_tokens``
        tokens. Zero-filled: a forward whose input kernels did not run (compile-only warm-up, which
        runs only for models without state slots) still reads valid ids and the null block."""
        self.device = device
        self.pin_memory = pin_memory

        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.idx_mapping = zeros(max_num_reqs, dtype=torch.int64)  # [B] batch position -> table row
        self.query_start_loc = zeros(max_num_reqs + 1, dtype=torch.int32)  # [B + 1]
        self.input_ids = zeros(max_num_tokens, dtype=torch.int64)  # [T]
        self.positions = zeros(max_num_tokens, dtype=torch.int64)  # [T]
        self.seq_lens = zeros(max_num_reqs, dtype=torch.int32)  # [B]
        self.block_tables = zeros(num_groups, max_num_reqs, max_blocks_per_req, dtype=torch.int32)  # [G, B, blocks]
        self.slot_mappings = zeros(num_groups, max_num_tokens, dtype=torch.int64)  # [G, T]
        self.state_indices = zeros(max_num_reqs, dtype=torch.int32) if has_state else None  # [B]

    def copy_from_host(self, buffer: torch.Tensor, array: np.ndarray) -> torch.Tensor:
        """``buffer[:len(array)] = array`` without an implicit sync; returns that slice.

        The source is a fresh (pinned) tensor each time, never a reused one the host might
        overwrite while the copy is in flight; the copy runs on the current stream, after the
        previous step's kernels that read the buffer.
        """
        target = buffer[: len(array)]
        source = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            target.copy_(source)
            return target
        if self.pin_memory:
            source = source.pin_memory()
        target.copy_(source, non_blocking=self.pin_memory)
        return target
