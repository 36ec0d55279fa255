"""CUDA graphs for decode-only batches.

A decode batch of ``num_reqs`` requests (one query token each) is padded to the next captured
size and replayed from a graph holding the whole model forward and the logits. Under speculative
decoding a second family of graphs has ``width = 1 + num_speculative_tokens`` token slots per
request (vLLM's uniform decode with drafts): any batch whose requests each have at most that many
tokens replays one, the tokens past its last request belonging to none (slot -1); those graphs
give the hidden states, the logits of the rows verification needs being taken after. The graphs read
the runner's persistent input buffers (``weir.runner.input_buffers``), which the input-prep
kernels fill before each replay. Padding requests point at the request table's spare row, whose
block tables are all null block, so they read and write only the null block (and, in hybrid
models, only the padding state slot). Capture goes through the runner's own step
(``ModelRunner.dummy_run``), largest batch first, into one memory pool that smaller batches
share; the pool's size is measured, not guessed.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable

import torch

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


class CudaGraphs:
    """The captured decode graphs, by padded batch size, and their shared memory pool."""

    def __init__(self, device: torch.device, capture_sizes: list[int]):
        self.device = device
        self.capture_sizes = sorted(capture_sizes)
        self.graphs: dict = {}  # by size, or (size, width) for graphs of width > 1
        self._captured: dict[int, list[int]] = {}  # width -> sizes with a graph, ascending
        self.logits: dict = {}  # each graph's output: logits [size, vocab], or what its forward returned
        self.pool_bytes = 0
        self._pool = None
        self._stream = None

    def padded_size(self, num_reqs: int, width: int = 1) -> int | None:
        """The smallest captured batch size of this width that holds ``num_reqs`` requests, or None."""
        captured = self._captured.get(width, [])
        index = bisect.bisect_left(captured, num_reqs)
        return captured[index] if index < len(captured) else None

    @staticmethod
    def key(batch_size: int, width: int = 1):
        return batch_size if width == 1 else (batch_size, width)

    @contextlib.contextmanager
    def capturing(self, eager_first: bool):
        """Around the captures of every size: measures the pool they leave behind."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as after the captures: free memory then counts no cached blocks
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._pool = torch.cuda.graph_pool_handle()
        # Not torch.cuda.graph: it empties the allocator's cache before every capture, so each
        # eager run after it pays cudaMalloc again.
        self._stream = torch.cuda.Stream(self.device)
        yield
        torch.cuda.synchronize(self.device)
        # Eager runs leave their blocks cached outside the graphs' pool; return them, so that
        # what is measured below is the pool alone.
        torch.cuda.empty_cache()
        self.pool_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d decode CUDA graphs (batch 1..%d%s) in %.1f s, %.2f GiB", len(self.graphs),
                    self.capture_sizes[-1], ", each run eagerly first" if eager_first else "",
                    time.perf_counter() - start, self.pool_bytes / 2**30)

    def capture(self, batch_size: int, forward: Callable[[], torch.Tensor], width: int = 1) -> None:
        """Record ``forward()`` (returning logits [batch_size, vocab], or any tensors the caller
        reads after a replay) as the graph of this size and width."""
        graph = torch.cuda.CUDAGraph()
        main_stream = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main_stream)
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool)
            try:
                self.logits[self.key(batch_size, width)] = forward()
            finally:
                graph.capture_end()
        main_stream.wait_stream(self._stream)
        self.graphs[self.key(batch_size, width)] = graph
        bisect.insort(self._captured.setdefault(width, []), batch_size)

    def replay(self, batch_size: int, width: int = 1):
        """Run the graph of this size and width on the input buffers' current contents; returns its
        output (the captured forward's)."""
        key = self.key(batch_size, width)
        self.graphs[key].replay()
        return self.logits[key]
