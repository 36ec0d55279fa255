"""The attention-backend interface, and the per-step metadata every backend receives.

A backend turns one step's inputs into its own metadata once (``build_metadata``), then runs
``forward`` for every attention layer with that metadata. Models never see backend internals:
they call ``Attention`` (``weir.layers.attention``), which calls the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from weir.layer_cache import LayerBackend, PagedCacheSpec


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class AttentionLayerSpec(PagedCacheSpec):
    """What a softmax-attention layer needs from the backend and from the paged KV cache.

    ``sliding_window`` W (None: full attention) follows transformers: the query at position p
    sees the keys at positions ``p - W + 1 .. p``. Blocks wholly before a request's window may
    already be freed and handed to another request, so a backend must not read them.
    ``has_sinks``: the layer passes ``sinks [num_heads]`` (fp32) to ``forward``, one extra logit
    per head in the softmax denominator whose value row is zero (GPT-OSS, Granite SWA).
    """

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    has_sinks: bool = False

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"layer {self.layer_idx}: sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def kind(self) -> str:
        """The layer kind a backend must serve (``AttentionBackend.supported_layer_kinds``)."""
        return SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION


@dataclass
class AttentionMetadata:
    """Step inputs shared by every attention layer of one forward.

    Requests are laid out in batch order; request ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]``, and after this step its cache holds
    ``seq_lens[i]`` tokens (the computed prefix plus the tokens scheduled now).
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device; -1 = padding, not stored
    num_reqs: int
    num_tokens: int
    # Host-side bounds the scheduler knows exactly; reading them needs no device sync.
    max_query_len: int
    max_seq_len: int
    # Tokens from query_start_loc[num_reqs] to num_tokens belong to no request (the padding of a
    # mixed-step or speculative-width graph); a backend writes zeros to their output rows, so the
    # layers after attention (a MoE router among them) see finite values there.
    has_unowned_tokens: bool = False


class AttentionBackend(LayerBackend, ABC):
    """A way to compute attention over the paged KV cache: the base of every paged layer backend.

    Subclasses declare the devices and layer kinds they support (``LayerBackend``). Registered
    through the ``weir_attention_backends`` hook; constructed as ``cls(block_size, dtype, device)``.
    The runner allocates each layer's cache through ``allocate_kv_cache`` and hands it back to
    ``forward``; a backend for another paged kind (an MLA latent, say) overrides the cache shape
    and gives ``forward`` the arguments its layers pass.
    """

    supported_layer_kinds: ClassVar[frozenset[str]] = frozenset({FULL_ATTENTION})
    # Whether ``forward`` takes ``sinks`` (layers with ``has_sinks``).
    supports_sinks: ClassVar[bool] = False

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    def kv_cache_shape(self, num_blocks: int, layer: AttentionLayerSpec) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: K and V stacked on the first axis."""
        return (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)

    def kv_cache_bytes_per_block(self, layer: PagedCacheSpec) -> int:
        return math.prod(self.kv_cache_shape(1, layer)) * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int, layer: PagedCacheSpec) -> torch.Tensor:
        """A zeroed cache of ``num_blocks`` blocks for ``layer`` (block 0 is the null block, which
        absorbs padding writes and must stay finite)."""
        return torch.zeros(self.kv_cache_shape(num_blocks, layer), dtype=self.dtype, device=self.device)

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Once per step: derive whatever the backend needs beyond the common metadata."""
        return metadata

    def warmup_shapes(self, layer: AttentionLayerSpec, max_prefill_len: int, decode_batches: list[int],
                      decode_seq_len: int) -> list[tuple[list[int], list[int]]]:
        """``(query_lens, seq_lens)`` of attention calls that between them launch every kernel
        variant real steps will: prefills of up to ``max_prefill_len`` tokens beside a decode,
        and decode batches of ``decode_batches`` sizes at ``decode_seq_len`` keys (as the CUDA
        graphs are captured). Start-up runs them in parallel threads so compilers overlap; a
        backend that knows which shapes share a variant returns one shape per variant."""
        shapes = []
        query_len = 2
        while query_len <= max_prefill_len:
            shapes.append(([1, query_len], [1, query_len]))
            query_len *= 2
        return shapes + [([1] * batch, [decode_seq_len] * batch) for batch in decode_batches]

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32, only for layers with has_sinks
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store this step's K/V into the cache at ``slot_mapping``, then attend causally (within
        ``layer.sliding_window`` when set). ``sinks`` is passed only when the layer has them, so a
        backend without ``supports_sinks`` may leave the argument out."""
