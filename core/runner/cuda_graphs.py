"""CUDA graphs for decode batches and, where every backend allows it, for mixed ones.

A decode batch of ``num_reqs`` requests (one query token each) is padded to the next captured
size and replayed from a graph holding the whole model forward and the logits. Under speculative
decoding a second family of graphs has ``width = 1 + num_speculative_tokens`` token slots per
request (vLLM's uniform decode with drafts): any batch whose requests each have at most that many
tokens replays one, the tokens past its last request belonging to none (slot -1); those graphs
give the hidden states, the logits of the rows verification needs being taken after; a draft
network's passes after them replay graphs of their own (``capture_named``,
``weir.spec_decode.proposal_graphs``). The graphs read
the runner's persistent input buffers (``weir.runner.input_buffers``), which the input-prep
kernels fill before each replay. Padding requests point at the request table's spare row, whose
block tables are all null block, so they read and write only the null block (and, in hybrid
models, only the padding state slot). Capture goes through the runner's own step
(``ModelRunner.dummy_run``), largest batch first, into one memory pool that smaller batches
share; the pool's size is measured, not guessed.

Mixed steps (prefill chunks beside decodes) replay a graph too when every layer backend declares
``supports_mixed_cuda_graphs`` and no layer keeps a per-request state: such a step is padded to
one of ``MIXED_TOKEN_SIZES`` tokens and ``MIXED_BATCH_SIZES`` requests (padding requests own no
token, and padding tokens belong to no request), and the graph holds its whole forward and the
logits of every request's last token. Those logits go to one buffer that every mixed-step graph
shares (a step replays one graph and samples before the next), so more shapes cost no more
memory. An eager mixed step launches a few hundred kernels from Python; on a slow host that costs
more than the GPU spends on a short prefill chunk and on the decodes beside it, and every request
running meanwhile waits for it. Larger steps run eagerly: their GPU time hides the launches.
Attention writes zeros to the padding tokens' rows (``AttentionMetadata.has_unowned_tokens``):
every later op is row-wise, so they stay finite, and a MoE router sends them to real experts
(wasted work, bounded by the token sizes' spacing) rather than to garbage indices.
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


# Mixed-step graphs: token counts and request counts; steps with more of either run eagerly.
# Where a step's GPU time is mostly its prefill tokens, a padded token costs as much as a real
# one: 128-token steps keep that under an eighth past 1,024 tokens.
MIXED_TOKEN_SIZES = (64, 128, *range(256, 2048 + 1, 128))
MIXED_BATCH_SIZES = (32, 128)


def mixed_graph_shapes(max_num_batched_tokens: int, max_running_reqs: int,
                       max_model_len: int) -> list[tuple[int, int]]:
    """(num_tokens, num_reqs) of each mixed-step graph, largest first: shapes a step can have. A
    mixed step has a request of two tokens or more, so a shape holds more tokens than requests,
    and at most ``max_model_len`` per request."""
    batches = sorted({min(size, max_running_reqs) for size in MIXED_BATCH_SIZES})
    tokens = [size for size in MIXED_TOKEN_SIZES if size <= max_num_batched_tokens]
    return sorted(((t, b) for t in tokens for b in batches if b < t <= b * max_model_len), reverse=True)


def mixed_capture_lens(num_tokens: int, batch: int, max_model_len: int) -> list[int]:
    """Query lengths of a fake mixed step of exactly ``num_tokens`` tokens over ``batch``
    requests (``num_tokens > batch``): decodes, and the rest in as few prefill chunks of at most
    ``max_model_len`` tokens as hold it."""
    chunks = 1
    while num_tokens - (batch - chunks) > chunks * max_model_len:
        chunks += 1
    if chunks > batch:
        raise ValueError(f"{batch} requests of at most {max_model_len} tokens cannot hold {num_tokens} tokens")
    base, extra = divmod(num_tokens - (batch - chunks), chunks)
    return [1] * (batch - chunks) + [base + (1 if i < extra else 0) for i in range(chunks)]


def graph_pool_bytes_estimate(activation_peak_bytes: int, capture_sizes: list[int], logits_row_bytes: int) -> int:
    """Memory the graphs' pool will hold: one set of activations for the largest batch (the
    captures reuse it, largest first: ``activation_peak_bytes`` of an eager run; with mixed-step
    graphs, add their largest shape's run, whose blocks the decode graphs captured after them may
    not fit in) plus every decode graph's own logits output, which stays alive for replays
    ([size, vocab] each, beyond the largest's; the mixed-step graphs' shared one is in their peak)."""
    extra_logits = sorted(capture_sizes)[:-1]
    return activation_peak_bytes + sum(_allocator_rounded(size * logits_row_bytes) for size in extra_logits)


def _allocator_rounded(num_bytes: int) -> int:
    """torch's caching allocator rounds blocks over 1 MiB up to a multiple of 2 MiB."""
    return num_bytes if num_bytes <= 2**20 else -(-num_bytes // 2**21) * 2**21


class CudaGraphs:
    """The captured graphs, by padded batch size (and token count for mixed steps), and their
    shared memory pool."""

    def __init__(self, device: torch.device, capture_sizes: list[int]):
        self.device = device
        self.capture_sizes = sorted(capture_sizes)
        self.graphs: dict = {}  # by size, or (size, width) for graphs of width > 1
        self._captured: dict[int, list[int]] = {}  # width -> sizes with a graph, ascending
        self._mixed: dict[int, list[int]] = {}  # mixed steps: batch size -> token counts with a graph, ascending
        self._mixed_logits: torch.Tensor | None = None  # [largest mixed batch, vocab], every mixed graph's output
        self.logits: dict = {}  # each graph's output: logits [size, vocab], or what its forward returned
        self._named: dict = {}  # key -> (graph, output): graphs outside the step families (capture_named)
        self.pool_bytes = 0
        self._pool = None
        self._stream = None

    def padded_size(self, num_reqs: int, width: int = 1) -> int | None:
        """The smallest captured batch size of this width that holds ``num_reqs`` requests, or None."""
        captured = self._captured.get(width, [])
        index = bisect.bisect_left(captured, num_reqs)
        return captured[index] if index < len(captured) else None

    def padded_mixed(self, num_reqs: int, num_tokens: int) -> tuple[int, int] | None:
        """(num_tokens, batch size) of the smallest mixed-step graph that holds a step of
        ``num_reqs`` requests and ``num_tokens`` tokens (its padding requests own none), or None."""
        for batch in sorted(self._mixed):
            if batch < num_reqs:
                continue
            sizes = self._mixed[batch]
            index = bisect.bisect_left(sizes, num_tokens)
            if index < len(sizes):
                return sizes[index], batch
        return None

    @staticmethod
    def key(batch_size: int, width: int = 1, num_tokens: int | None = None):
        if num_tokens is not None:
            return ("mixed", num_tokens, batch_size)
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
        num_mixed = sum(map(len, self._mixed.values()))
        mixed = (f", {num_mixed} mixed-step ones (up to {max(max(s) for s in self._mixed.values())} tokens)"
                 if num_mixed else "")
        named = f", {len(self._named)} of a proposer's passes" if self._named else ""
        eager = ", each run eagerly first" if eager_first else ""
        logger.info("captured %d decode CUDA graphs (batch 1..%d%s)%s%s in %.1f s, %.2f GiB",
                    len(self.graphs) - num_mixed, self.capture_sizes[-1], eager, mixed, named,
                    time.perf_counter() - start, self.pool_bytes / 2**30)

    def capture(self, batch_size: int, forward: Callable[[], torch.Tensor], width: int = 1,
                num_tokens: int | None = None) -> None:
        """Record ``forward()`` (returning logits [batch_size, vocab], or any tensors the caller
        reads after a replay) as the graph of this size and width, or of a mixed step of
        ``num_tokens`` tokens. Mixed-step graphs write their logits into one shared buffer: the
        first one captured (the largest batch, shapes go largest first) keeps its own output as
        that buffer, the others copy theirs into its leading rows and leave theirs to the pool."""
        key = self.key(batch_size, width, num_tokens)
        share = self._share_mixed_output if num_tokens is not None else None
        self.graphs[key], self.logits[key] = self._record(forward, share)
        if num_tokens is None:
            bisect.insort(self._captured.setdefault(width, []), batch_size)
        else:
            bisect.insort(self._mixed.setdefault(batch_size, []), num_tokens)

    def capture_named(self, key: tuple, forward: Callable[[], torch.Tensor]) -> None:
        """Record ``forward()`` as a graph outside the step families (a proposer's passes after
        a step's graph), in the same pool: it replays after that step's graph, never beside it."""
        self._named[key] = self._record(forward)

    def replay_named(self, key: tuple) -> torch.Tensor | None:
        """Run the named graph; its output, or None when none was captured under ``key``."""
        if key not in self._named:
            return None
        graph, output = self._named[key]
        graph.replay()
        return output

    def _record(self, forward: Callable[[], torch.Tensor], transform: Callable | None = None):
        graph = torch.cuda.CUDAGraph()
        main_stream = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main_stream)
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool)
            try:
                output = forward()
                if transform is not None:
                    output = transform(output)
            finally:
                graph.capture_end()
        main_stream.wait_stream(self._stream)
        return graph, output

    def _share_mixed_output(self, logits: torch.Tensor) -> torch.Tensor:
        shared = self._mixed_logits
        if shared is None:
            self._mixed_logits = logits
            return logits
        if logits.shape[0] > shared.shape[0] or logits.shape[1:] != shared.shape[1:] or logits.dtype != shared.dtype:
            raise RuntimeError(f"mixed-step graph logits {tuple(logits.shape)} {logits.dtype} do not fit the shared "
                               f"buffer {tuple(shared.shape)} {shared.dtype}: capture the largest batch first")
        rows = shared[: logits.shape[0]]
        rows.copy_(logits)
        return rows

    def replay(self, batch_size: int, width: int = 1, num_tokens: int | None = None):
        """Run the graph of this size and width (or mixed-step token count) on the input buffers'
        current contents; returns its output (the captured forward's)."""
        key = self.key(batch_size, width, num_tokens)
        self.graphs[key].replay()
        return self.logits[key]
