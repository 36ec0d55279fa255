"""Paged attention in Triton: the default full- and sliding-window attention backend on CUDA
(and ROCm) devices, with or without attention sinks.

Each forward stores this step's K/V (``weir.kernels.kv_store``: padding slots skipped), then:
- a pure decode batch (``max_query_len == 1``) runs the decode kernel, split over the key
  length when the batch alone would leave most SMs idle, plus a reduce kernel for the splits;
- any other batch runs the decode kernel (splits off) for its query_len-1 requests and the varlen
  prefill kernel for the rest, which attends over cached prefix blocks and this step's tokens.
Grids come from host ints only, so no step syncs, and a launch with a fixed padded ``num_reqs``
(and, for a mixed batch, ``num_tokens`` and ``max_query_len``) can be captured in a CUDA graph:
lengths are read from the metadata tensors, and query tiles past the last request exit at once.
A layer's window and sinks are constexpr flags of both kernels: each combination a model
uses is one more compiled variant, and layers without them run the same code as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from weir.attention import (FULL_ATTENTION, SLIDING_ATTENTION, AttentionBackend, AttentionLayerSpec,
                            AttentionMetadata)
from weir.kernels.kv_store import store_kv
from weir.plugins.attention.torch_ref import check_sinks
from weir.plugins.attention.triton_paged_decode import decode_kernel, decode_reduce_kernel
from weir.plugins.attention.triton_paged_kernels import LOG2_E, prefill_kernel, zero_unowned_rows_kernel

# A split below this many keys costs more in partial writes and merging than it saves.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
SPLIT_TARGET_WAVES = 2  # aim for this many programs per SM before splitting stops paying


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch shape of one kernel (block_m: query rows = tokens x group heads)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_prefill_tiles(head_dim: int, max_query_len: int, group_p: int, dtype: torch.dtype) -> TileConfig:
    if dtype == torch.float32:  # exact fp32 dots (tests, CPU-style runs) need small tiles to avoid spills
        config = TileConfig(32, 32, 4, 2)
    elif head_dim <= 64:
        config = TileConfig(128, 64, 4, 3)
    elif head_dim <= 128:
        config = TileConfig(128, 64, 8, 3)
    else:  # 256: a 128-row fp32 accumulator would not fit in registers
        config = TileConfig(64, 32, 8, 2)
    # Short queries (chunked prefill, a few tokens per request) waste less with smaller tiles.
    rows_needed = max(16, triton.next_power_of_2(max_query_len * group_p))
    block_m = max(group_p, min(config.block_m, rows_needed))
    num_warps = 4 if block_m <= 64 and head_dim <= 128 else config.num_warps
    return TileConfig(block_m, config.block_n, num_warps, config.num_stages)


def default_decode_tiles(head_dim: int) -> TileConfig:
    return TileConfig(16, 32 if head_dim > 128 else 64, 4, 3)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention over the ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache."""

    name = "triton"
    supported_devices = frozenset({"cuda"})
    supported_layer_kinds = frozenset({FULL_ATTENTION, SLIDING_ATTENTION})
    supports_sinks = True
    supports_cuda_graphs = True
    supports_mixed_cuda_graphs = True  # the prefill grid is bounded by num_tokens and num_reqs alone

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(block_size, dtype, device)
        device = torch.device(device)
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 8)
        # Overrides for tests and the benchmark's tile sweep; None = the heuristics above.
        self.prefill_tiles: TileConfig | None = None
        self.decode_tiles: TileConfig | None = None
        self.forced_num_splits: int | None = None

    def kv_cache_shape(self, num_blocks: int, layer: AttentionLayerSpec) -> tuple[int, ...]:
        check_head_dim(layer.head_dim)
        return super().kv_cache_shape(num_blocks, layer)

    def num_kv_splits(self, num_reqs: int, num_kv_heads: int, max_seq_len: int) -> int:
        """How many programs share one (request, kv head) of a decode batch; host ints only.

        ``max_seq_len`` is the most keys one request reads: ``min(max_seq_len, W)`` for a window.
        """
        if self.forced_num_splits is not None:
            return self.forced_num_splits
        programs = num_reqs * num_kv_heads
        wanted = triton.cdiv(SPLIT_TARGET_WAVES * self.num_sms, programs)
        return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_KEYS_PER_SPLIT), MAX_SPLITS))

    def warmup_shapes(self, layer: AttentionLayerSpec, max_prefill_len: int, decode_batches: list[int],
                      decode_seq_len: int) -> list[tuple[list[int], list[int]]]:
        """One shape per kernel variant: per prefill tile config, per decode split class (a
        window's decode splits follow from its length). The window and sinks flags are the
        layer's: layers that differ in them (full and sliding, with and without sinks) are
        different variants, so warm-up asks once per distinct combination."""
        group_p = triton.next_power_of_2(layer.num_heads // layer.num_kv_heads)
        by_variant: dict[tuple, tuple[list[int], list[int]]] = {}
        for query_lens, seq_lens in super().warmup_shapes(layer, max_prefill_len, decode_batches, decode_seq_len):
            if max(query_lens) > 1:
                variant = ("prefill", self.prefill_tiles or default_prefill_tiles(
                    layer.head_dim, max(query_lens), group_p, self.dtype))
            else:
                splits = self.num_kv_splits(len(query_lens), layer.num_kv_heads,
                                            keys_read(layer, decode_seq_len))
                variant = ("decode", triton.next_power_of_2(splits) if splits > 1 else 1)
            by_variant.setdefault(variant, (query_lens, seq_lens))
        return list(by_variant.values())

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        check_head_dim(layer.head_dim)
        check_sinks(layer, sinks)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        num_tokens, num_reqs = metadata.num_tokens, metadata.num_reqs
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        flags = LayerFlags.of(layer, sinks, out)
        if q.shape[0] > num_tokens:  # padded rows (CUDA graphs): keep them finite for later ops
            out[num_tokens:].zero_()
        if num_tokens == 0 or num_reqs == 0:
            return out
        store_kv(kv_cache, k[:num_tokens], v[:num_tokens], metadata.slot_mapping[:num_tokens])
        group = layer.num_heads // layer.num_kv_heads
        group_p = max(16, triton.next_power_of_2(group))
        qk_scale = layer.scale * LOG2_E
        # fp32 stays exact (no tf32); None = the target's default for 16-bit inputs.
        precision = "ieee" if q.dtype == torch.float32 else None
        cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))

        num_splits = 1
        if metadata.max_query_len == 1:
            num_splits = self.num_kv_splits(num_reqs, layer.num_kv_heads, keys_read(layer, metadata.max_seq_len))
        tiles = self.decode_tiles or default_decode_tiles(layer.head_dim)
        if num_splits > 1:
            # Contiguous, so the lse buffer's offsets are the output buffer's divided by head_dim.
            partial_out = torch.empty((num_reqs, layer.num_heads, num_splits, layer.head_dim),
                                      dtype=torch.float32, device=q.device)
            partial_lse = torch.empty((num_reqs, layer.num_heads, num_splits), dtype=torch.float32,
                                      device=q.device)
        else:
            partial_out = partial_lse = out  # unused: SPLIT is off
        partial_strides = (partial_out.stride(0), partial_out.stride(1), partial_out.stride(2))
        decode_kernel[(num_reqs, layer.num_kv_heads, num_splits)](
            q, kv_cache, out, partial_out, partial_lse,
            metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            num_splits, qk_scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), metadata.block_tables.stride(0),
            *cache_strides, *partial_strides, flags.window, flags.sinks,
            GROUP=group, GROUP_P=group_p, HEAD_DIM=layer.head_dim, BLOCK_N=tiles.block_n,
            BLOCK_SIZE=kv_cache.shape[2], SPLIT=num_splits > 1, PRECISION=precision,
            SLIDING=flags.sliding, HAS_SINKS=flags.has_sinks,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        if num_splits > 1:
            decode_reduce_kernel[(num_reqs, layer.num_heads)](
                out, partial_out, partial_lse, metadata.query_start_loc,
                num_splits, out.stride(0), out.stride(1), *partial_strides, flags.sinks,
                HEAD_DIM=layer.head_dim, NUM_SPLITS_P=triton.next_power_of_2(num_splits),
                HAS_SINKS=flags.has_sinks, num_warps=4,
            )
        if metadata.max_query_len > 1:
            self._prefill(layer, q, kv_cache, out, metadata, group, qk_scale, precision, cache_strides, flags)
        if metadata.has_unowned_tokens:
            zero_unowned_rows(out, metadata)
        return out

    def _prefill(self, layer, q, kv_cache, out, metadata, group, qk_scale, precision, cache_strides, flags):
        """The varlen kernel for every request with query_len >= 2."""
        group_p = triton.next_power_of_2(group)
        tiles = self.prefill_tiles or default_prefill_tiles(layer.head_dim, metadata.max_query_len, group_p,
                                                                 q.dtype)
        block_q = max(1, tiles.block_m // group_p)
        # Upper bound on query tiles (see find_request), known on the host without a sync.
        num_tiles = metadata.num_tokens // block_q + metadata.num_reqs
        prefill_kernel[(num_tiles, layer.num_kv_heads)](
            q, kv_cache, out, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            metadata.num_reqs, qk_scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), metadata.block_tables.stride(0),
            *cache_strides, flags.window, flags.sinks,
            GROUP=group, GROUP_P=group_p, HEAD_DIM=layer.head_dim, BLOCK_Q=block_q,
            BLOCK_N=tiles.block_n, BLOCK_SIZE=kv_cache.shape[2], PRECISION=precision,
            SLIDING=flags.sliding, HAS_SINKS=flags.has_sinks,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )


@dataclass(frozen=True)
class LayerFlags:
    """A layer's window and sinks as the kernels take them: constexpr flags and their operands."""

    sliding: bool
    window: int  # W, or 0 when not sliding (unread)
    has_sinks: bool
    sinks: torch.Tensor  # [num_heads]; any tensor when has_sinks is off (unread)

    @classmethod
    def of(cls, layer: AttentionLayerSpec, sinks: torch.Tensor | None, placeholder: torch.Tensor) -> LayerFlags:
        if sinks is not None and (sinks.device != placeholder.device or sinks.stride(0) != 1):
            raise ValueError(f"layer {layer.layer_idx}: sinks must be a contiguous tensor on "
                             f"{placeholder.device}, got stride {sinks.stride()} on {sinks.device}")
        window = layer.sliding_window
        return cls(sliding=window is not None, window=window or 0, has_sinks=sinks is not None,
                   sinks=sinks if sinks is not None else placeholder)


def zero_unowned_rows(out: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Zero ``out``'s rows [num_tokens, ...] of the tokens that belong to no request."""
    rows = out.view(out.shape[0], -1)  # [num_tokens, num_heads * head_dim]
    block_t = 16
    zero_unowned_rows_kernel[(triton.cdiv(metadata.num_tokens, block_t),)](
        rows, metadata.query_start_loc, metadata.num_reqs, metadata.num_tokens, rows.stride(0),
        ROW_ELEMS=rows.shape[1], BLOCK_T=block_t, BLOCK_C=min(1024, triton.next_power_of_2(rows.shape[1])),
        num_warps=4,
    )


def keys_read(layer: AttentionLayerSpec, max_seq_len: int) -> int:
    """The most keys one decode query reads: the whole sequence, or its window."""
    if layer.sliding_window is None:
        return max_seq_len
    return min(max_seq_len, layer.sliding_window)


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"the triton attention backend needs head_dim a power of two in 16..256, got "
                         f"{head_dim}; choose another backend (--attention-backend torch)")
