"""CUDA graphs for decode-only batches.

A decode batch of ``num_reqs`` requests (one query token each) is padded to the next captured
size and replayed from a graph that holds the whole model forward plus the logits. Padding
requests point at the request table's spare row, whose block table is all null block, so
they read and write only the null block (and, in hybrid models, only the padding state slot).
Graphs are captured largest first into one memory pool (smaller batches reuse the larger ones'
memory); the pool's size is measured, not guessed.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from weir.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    largest = min(max_num_seqs, limit)
    sizes = [1, 2, 4, 8] + list(range(16, largest + 1, 16))
    return sorted({size for size in sizes if size <= largest} | {largest})


def graph_pool_bytes_estimate(decode_peak_bytes: int, capture_sizes: list[int], logits_row_bytes: int) -> int:
    """Memory the graphs' pool will hold: one set of activations for the largest batch (the
    captures reuse it, largest first: ``decode_peak_bytes`` of an eager run) plus every graph's
    own logits output, which stays alive for replays ([size, vocab] each, beyond the largest's)."""
    extra_logits = sorted(capture_sizes)[:-1]
    return decode_peak_bytes + sum(_allocator_rounded(size * logits_row_bytes) for size in extra_logits)


def _allocator_rounded(num_bytes: int) -> int:
    """torch's caching allocator rounds blocks over 1 MiB up to a multiple of 2 MiB."""
    return num_bytes if num_bytes <= 2**20 else -(-num_bytes // 2**21) * 2**21


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    query_start_loc: torch.Tensor  # [max_bs + 1] int32
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [max_bs] int64
    state_indices: torch.Tensor | None  # [max_bs] int32, hybrid models only


class CudaGraphRunner:
    def __init__(self, runner, capture_sizes: list[int]):
        """``runner``: the ModelRunner whose model, caches and backends the graphs capture."""
        self.runner = runner
        self.model = runner.model
        self.capture_sizes = sorted(capture_sizes)
        self.max_model_len = runner.config.scheduler.max_model_len
        max_blocks_per_req, device = runner.max_blocks_per_req, runner.device
        max_bs = self.capture_sizes[-1]
        self.static = _StaticInputs(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_bs, max_blocks_per_req, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(max_bs, dtype=torch.int64, device=device),
            state_indices=(torch.full((max_bs,), runner.num_state_slots, dtype=torch.int32, device=device)
                           if runner.state_layers else None),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0

    def padded_size(self, num_reqs: int) -> int | None:
        index = bisect.bisect_left(self.capture_sizes, num_reqs)
        return self.capture_sizes[index] if index < len(self.capture_sizes) else None

    def _forward(self, batch_size: int) -> torch.Tensor:
        s = self.static
        metadata = AttentionMetadata(
            query_start_loc=s.query_start_loc[: batch_size + 1], seq_lens=s.seq_lens[:batch_size],
            block_tables=s.block_tables[:batch_size], slot_mapping=s.slot_mapping[:batch_size],
            num_reqs=batch_size, num_tokens=batch_size, max_query_len=1, max_seq_len=self.max_model_len,
        )
        state_indices = s.state_indices[:batch_size] if s.state_indices is not None else None
        ctx = self.runner.forward_context(metadata, self.runner.kv_caches, state_indices)
        hidden = self.model(self.static.input_ids[:batch_size], self.static.positions[:batch_size], ctx)
        return self.model.compute_logits(hidden)  # [batch_size, vocab]

    @torch.inference_mode()
    def capture(self, eager_first: bool = True) -> None:
        """Capture every size, largest first, into one pool. ``eager_first`` runs each size once
        before its capture, so kernels that compile or autotune on first launch (fla's, MoE tiles)
        do it outside the capture; without it, every kernel must already be compiled and loaded
        (cuBLAS kernels for new shapes still load lazily inside the capture: CUDA 12.3 or newer)."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as after the loop: free memory then counts no cached blocks
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        # Not torch.cuda.graph: it empties the allocator's cache before every capture, so each
        # eager run after it pays cudaMalloc again.
        capture_stream = torch.cuda.Stream(self.runner.device)
        for batch_size in reversed(self.capture_sizes):
            if eager_first:
                self._forward(batch_size)
            graph = torch.cuda.CUDAGraph()
            capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(capture_stream):
                graph.capture_begin(pool=pool)
                try:
                    self.logits[batch_size] = self._forward(batch_size)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(capture_stream)
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()
        # Eager runs leave their blocks cached outside the graphs' pool; return them, so that
        # what is measured below is the pool alone.
        torch.cuda.empty_cache()
        self.pool_bytes = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured %d decode CUDA graphs (batch 1..%d%s) in %.1f s, %.2f GiB",
                    len(self.graphs), self.capture_sizes[-1], ", each run eagerly first" if eager_first else "",
                    time.perf_counter() - start, self.pool_bytes / 2**30)

    def replay(self, batch_size: int, input_ids, positions, seq_lens, block_tables, slot_mapping,
               state_indices=None) -> torch.Tensor:
        """Inputs are already padded to ``batch_size``; returns logits [batch_size, vocab]."""
        s = self.static
        if state_indices is not None:
            s.state_indices[:batch_size].copy_(state_indices)
        s.input_ids[:batch_size].copy_(input_ids)
        s.positions[:batch_size].copy_(positions)
        s.seq_lens[:batch_size].copy_(seq_lens)
        s.block_tables[:batch_size].copy_(block_tables)
        s.slot_mapping[:batch_size].copy_(slot_mapping)
        self.graphs[batch_size].replay()
        return self.logits[batch_size]
