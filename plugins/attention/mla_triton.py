"""MLA and DSA in Triton: the ``mla`` and ``sparse_mla`` backend on CUDA devices.

Each forward stores this step's latent, rope key (and indexer key) rows into the latent cache
(one kernel, padding slots skipped), then attends in the absorbed form for every token:
``q_lat = W_UK^T q_nope`` per head (one batched GEMM), MQA of all heads over the shared
576-dim latent key and 512-dim latent value (``mla_triton_kernels``), then ``o = W_UV o_lat``
(a second batched GEMM).

The attention kernel is ``mla_gluon_kernels``' on Hopper GPUs in 16-bit dtypes (Gluon: the two
warpgroups split the scores by keys and the accumulator by latent columns, key rows gathered by
cp.async two stages ahead), ``mla_triton_kernels``' elsewhere (and in CI, under Triton's CPU
interpreter, which Gluon lacks). Both take the same arguments and the same grid of programs.

- Decode batches (``max_query_len == 1``) split each token's keys over several programs when
  the batch alone would leave SMs idle, plus a reduce kernel for the splits.
- Prefill and mixed batches run the same kernel, one program per token and head block, each
  over the token's exact causal prefix, cached blocks and this step's rows alike, so chunked
  prefill over a cached prefix needs no other path. Prefill tokens use the absorbed form too.
  On sparse layers it is the form that fits: each query has its own key list, so there are no
  shared per-head keys to expand. On dense layers the expanded form does fewer FLOPs per
  (query, key) pair (640 per head against 2176) and was 1.2-1.8x faster on long prefills on an
  H200 than the Triton kernel (``bench_mla``: cuBLAS expansion + SDPA; not yet timed against the
  Gluon one), but after a cached prefix it re-expands the
  whole prefix every chunk into a buffer sized by the batch's total key count, which the host
  does not know (the metadata gives ``max_seq_len`` only), so it is not used yet.
- Sparse layers (DSA), once a request can hold more keys than ``index_topk``: indexer scores
  over each token's causal prefix of cached indexer keys, an exact top-k per token
  (``mla_triton_indexer``), its key positions turned into cache slots in place, and the attention
  kernel over only the selected latent rows.
  While ``max_seq_len <= index_topk`` every key is selected, so the dense path runs.

Grids come from host ints only and lengths are read from the metadata tensors, so no step syncs,
and decode batches and mixed steps padded to fixed shapes can be captured in CUDA graphs (every
kernel gives tokens owned by no request no key and a zero output row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from weir.attention import AttentionMetadata
from weir.mla import (MLA, SPARSE_MLA, IndexerInputs, MLABackend, MLALayerSpec, SelectedKeys, attended_keys,
                      check_forward_inputs)
from weir.plugins.attention.mla_triton_indexer import (indexer_block_scores_kernel, indexer_scores_kernel, topk_kernel,
                                                       topk_slots_kernel)
from weir.plugins.attention.mla_triton_kernels import mla_attention_kernel, mla_reduce_kernel, store_latent_kernel
from weir.plugins.attention.triton_paged_kernels import LOG2_E

try:  # the Hopper kernel, in Gluon; a triton without Gluon runs the Triton kernel everywhere
    from weir.plugins.attention import mla_gluon_kernels as wgmma_kernels
except ImportError:
    wgmma_kernels = None

# A split below this many keys costs more in partial writes and merging than it saves.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
SPLIT_TARGET_WAVES = 2  # aim for this many programs per SM before splitting stops paying
# A score row of at most this many keys stays in registers while the top-k bisects its threshold
# (on an H200 at 16k keys, faster than radix passes streaming blocks of 8k).
TOPK_BLOCK = 16384
TOPK_RESIDENT_WARPS = 16  # 32 registers of keys a thread; timed faster than 8 warps for resident rows
# Key tiles one indexer-score program covers, loading its tokens' q once (for the one-token kernel
# 1 and 4 timed the same on an H200 at decode B=32 and 256; 4 launches a quarter of the programs).
SCORE_TILES_PER_PROGRAM = 4
# Steps with a query of at least this many tokens (prefill chunks, also spec-decode verify and mixed
# steps) score a block of query tokens per program, sharing each key tile among them
# (indexer_block_scores_kernel). A block of one-token requests costs one dot a request, as a
# program of the one-token kernel does, but computes it for every row of the block.
BLOCK_SCORES_MIN_QUERY_LEN = 2
# The indexer's fp32 score rows are computed for this many bytes of query tokens at a time.
SCORE_BUFFER_BYTES = 256 << 20


@dataclass(frozen=True)
class ScoreTiles:
    """Tiles of the block-of-tokens indexer kernel: query tokens and keys per dot, launch shape."""

    block_t: int
    block_n: int
    num_warps: int
    num_stages: int


def default_score_tiles(index_heads: int, dtype: torch.dtype) -> ScoreTiles:
    """The block-of-tokens indexer kernel's tiles for ``index_heads`` heads in ``dtype``."""
    if dtype == torch.float32:  # exact fp32 dots: small tiles stay out of register spills
        return ScoreTiles(2, 64, 4, 2)
    # Two tokens of DeepSeek-V3.2's 64 heads: a [128 keys, 128] fp32 accumulator over 4 warps. On
    # an H200 (bench_mla --indexer-sweep) this beat four tokens, 8 warps and 64-key tiles.
    return ScoreTiles(max(1, 128 // max(16, triton.next_power_of_2(index_heads))), 128, 4, 3)


@dataclass(frozen=True)
class MLATiles:
    """Tile sizes and launch shape of the attention kernel (block_h: heads per program)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


def wgmma_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Gluon kernel (``mla_gluon_kernels``) runs here: a Hopper GPU (sm_90), a 16-bit
    cache and a triton with Gluon's 3.6 API or later."""
    if wgmma_kernels is None or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 6) and torch.cuda.get_device_capability(device)[0] == 9


def wgmma_fits(layer: MLALayerSpec) -> bool:
    """The Gluon kernel's shared memory (``mla_gluon_kernels.shared_bytes``) fits a Hopper block,
    and its [64, kv_lora_rank] fp32 accumulator half a warpgroup's registers (up to 512)."""
    return (layer.kv_lora_rank <= 512
            and wgmma_kernels.shared_bytes(layer.kv_lora_rank, layer.qk_rope_head_dim) <= wgmma_kernels.SHARED_BYTES)


def wgmma_aligned(*tensors: torch.Tensor) -> bool:
    """16-byte copies need 16-byte aligned rows: base addresses, and every stride but the last a
    multiple of 16 elements (the one the compiled kernel is told of)."""
    return all(t.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in t.stride()[:-1]) for t in tensors)


def default_attention_tiles(dtype: torch.dtype) -> MLATiles:
    if dtype == torch.float32:  # exact fp32 dots (tests) need small tiles to avoid spills
        return MLATiles(16, 16, 4, 1)
    # 64 heads x 512 fp32 accumulators over 8 warps: 128 registers a thread. On an H200 this beat
    # 32 keys a tile, 2 stages, 4 warps and 16 or 32 heads at decode B=32 and 256 (bench_mla --sweep).
    return MLATiles(64, 64, 8, 3)


@dataclass(frozen=True)
class StepPlan:
    """What one forward launches, from host ints only."""

    sparse: bool  # the indexer picks the keys (a sparse layer whose requests may exceed index_topk)
    num_splits: int
    topk_all_fit: bool  # every score row fits in one top-k register block (else each row picks its path)

    @property
    def variant(self) -> tuple:
        """The compiled kernel variants this plan launches (splits by power-of-two class)."""
        split_class = triton.next_power_of_2(self.num_splits) if self.num_splits > 1 else 1
        return self.sparse, split_class, self.topk_all_fit if self.sparse else None


class TritonMLABackend(MLABackend):
    """Absorbed MLA (and DSA) over the ``[num_blocks, block_size, cache_dim]`` latent cache."""

    name = "triton_mla"
    supported_devices = frozenset({"cuda"})
    supported_layer_kinds = frozenset({MLA, SPARSE_MLA})
    supports_cuda_graphs = True
    # Every grid is sized by num_tokens (and host bounds); tokens owned by no request get
    # position -1 in every kernel: no key, a zero output row, no indexer score.
    supports_mixed_cuda_graphs = True

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(block_size, dtype, device)
        device = torch.device(device)
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 8)
        # "wgmma" (Hopper, Gluon) or "triton"; tests and the benchmark set it to compare the two.
        self.attention_kernel = "wgmma" if wgmma_supported(device, dtype) else "triton"
        # Overrides for tests and the benchmark's sweep (Triton kernel); None = the heuristics above.
        self.attention_tiles: MLATiles | None = None
        self.forced_num_splits: int | None = None
        self.topk_block = TOPK_BLOCK
        self.topk_counting = True  # resident rows: bisect by counting (False: radix passes, as streamed rows)
        self.topk_warps = TOPK_RESIDENT_WARPS
        self.score_tiles_per_program = SCORE_TILES_PER_PROGRAM
        # The block-of-tokens indexer kernel's tiles; None: default_score_tiles.
        self.block_score_tiles: ScoreTiles | None = None
        self.block_scores_min_query_len = BLOCK_SCORES_MIN_QUERY_LEN
        self.score_buffer_bytes = SCORE_BUFFER_BYTES

    def kv_cache_shape(self, num_blocks: int, layer: MLALayerSpec) -> tuple[int, ...]:
        check_layer(layer)
        return super().kv_cache_shape(num_blocks, layer)

    def tiles(self) -> MLATiles:
        return self.attention_tiles or default_attention_tiles(self.dtype)

    def head_blocks(self, layer: MLALayerSpec, kernel: str | None = None) -> tuple[int, int]:
        """``(block_h, number of head blocks)`` of ``kernel`` (default: the chosen one): 64 rows for
        wgmma; for tl.dot at least 16, at most the heads."""
        if (kernel or self.attention_kernel) == "wgmma":
            block_h = wgmma_kernels.BLOCK_H
        else:
            block_h = max(16, min(self.tiles().block_h, triton.next_power_of_2(layer.num_heads)))
        return block_h, triton.cdiv(layer.num_heads, block_h)

    def num_kv_splits(self, num_programs: int, keys_read: int) -> int:
        """How many programs share one (token, head block) of a decode batch; host ints only."""
        if self.forced_num_splits is not None:
            return self.forced_num_splits
        wanted = triton.cdiv(SPLIT_TARGET_WAVES * self.num_sms, num_programs)
        return max(1, min(wanted, triton.cdiv(keys_read, MIN_KEYS_PER_SPLIT), MAX_SPLITS))

    def plan(self, layer: MLALayerSpec, num_tokens: int, max_query_len: int, max_seq_len: int) -> StepPlan:
        """The launches of a step with these host bounds (graphs: the capture-time bounds)."""
        sparse = layer.index_topk > 0 and max_seq_len > layer.index_topk
        num_splits = 1
        if max_query_len == 1:
            keys_read = min(max_seq_len, layer.index_topk) if sparse else max_seq_len
            num_splits = self.num_kv_splits(num_tokens * self.head_blocks(layer, self.layer_kernel(layer))[1],
                                            keys_read)
        return StepPlan(sparse, num_splits, max_seq_len <= self.topk_block)

    def warmup_shapes(self, layer: MLALayerSpec, max_prefill_len: int, decode_batches: list[int],
                      decode_seq_len: int) -> list[tuple[list[int], list[int]]]:
        """One shape per kernel variant: prefill (no splits), each decode split class, and for
        sparse layers two prefills past ``index_topk``: just past it (every score row resident)
        and at ``decode_seq_len`` (the top-k's variant that may stream, when that is past its
        resident block)."""
        candidates = super().warmup_shapes(layer, max_prefill_len, decode_batches, decode_seq_len)
        if layer.index_topk:
            for seq_len in (min(layer.index_topk + 2, decode_seq_len), decode_seq_len):
                if seq_len > layer.index_topk:
                    candidates.append(([1, 2], [seq_len, seq_len]))
        by_variant: dict[tuple, tuple[list[int], list[int]]] = {}
        for query_lens, seq_lens in candidates:
            plan = self.plan(layer, sum(query_lens), max(query_lens), max(seq_lens))
            by_variant.setdefault(plan.variant, (query_lens, seq_lens))
        return list(by_variant.values())

    def forward(
        self,
        layer: MLALayerSpec,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rope applied
        kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank], normalised
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rope applied
        kv_cache: torch.Tensor,  # [num_blocks, block_size, cache_dim]
        metadata: AttentionMetadata,
        w_uk: torch.Tensor,  # [num_heads, qk_nope_head_dim, kv_lora_rank]
        w_uv: torch.Tensor,  # [num_heads, v_head_dim, kv_lora_rank]
        indexer: IndexerInputs | None = None,
        selected: SelectedKeys | None = None,  # keys: topk_slots' [num_tokens, index_topk] slot lists
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        check_inputs(layer, q_nope, q_pe, kv_c, k_pe, kv_cache, w_uk, w_uv, indexer, self.block_size, selected)
        num_tokens = metadata.num_tokens
        out = torch.empty((q_nope.shape[0], layer.num_heads, layer.v_head_dim), dtype=q_nope.dtype,
                          device=q_nope.device)
        if q_nope.shape[0] > num_tokens:  # padded rows (CUDA graphs): keep them finite for later ops
            out[num_tokens:].zero_()
        if num_tokens == 0 or metadata.num_reqs == 0:
            return out
        self.store(layer, kv_c, k_pe, indexer, kv_cache, metadata.slot_mapping[:num_tokens])
        plan = self.plan(layer, num_tokens, metadata.max_query_len, metadata.max_seq_len)
        # Every layer of the kind shares one block table per request (one cache group), so the slot
        # lists a layer picked hold for the layers sharing its top-k.
        topk_slots = None
        if plan.sparse:
            topk_slots = attended_keys(layer, selected, lambda: self.topk_slots(layer, indexer, kv_cache, metadata))
        q_lat = torch.bmm(q_nope[:num_tokens].transpose(0, 1), w_uk)  # [H, T, kv_lora_rank]
        o_lat = torch.empty_like(q_lat)  # [H, T, kv_lora_rank]
        self.attend(layer, q_lat, q_pe, kv_cache, metadata, o_lat, plan, topk_slots)
        out[:num_tokens] = torch.bmm(o_lat, w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v_head_dim]
        return out

    def store(self, layer: MLALayerSpec, kv_c: torch.Tensor, k_pe: torch.Tensor, indexer: IndexerInputs | None,
              kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """This step's rows into the cache at ``slot_mapping`` (slot -1: not stored)."""
        index_k = indexer.k if indexer is not None else kv_c  # any tensor when there is no indexer
        store_latent_kernel[(slot_mapping.shape[0],)](
            kv_c, k_pe, index_k, kv_cache, slot_mapping,
            kv_c.stride(0), k_pe.stride(0), index_k.stride(0), kv_cache.stride(0), kv_cache.stride(1),
            LORA=layer.kv_lora_rank, ROPE=layer.qk_rope_head_dim, INDEX_DIM=layer.index_head_dim,
            BLOCK_SIZE=kv_cache.shape[1], HAS_INDEXER=indexer is not None,
            COLS_P=triton.next_power_of_2(layer.cache_dim), num_warps=4,
        )

    def indexer_topk(self, layer: MLALayerSpec, indexer: IndexerInputs, kv_cache: torch.Tensor,
                     metadata: AttentionMetadata) -> torch.Tensor:  # [num_tokens, index_topk] int32
        """Each token's ``index_topk`` key positions of highest indexer score over its causal
        prefix (the cache already holding this step's indexer keys), in ascending position,
        -1 past ``min(index_topk, position + 1)``."""
        num_tokens, row_len = metadata.num_tokens, metadata.max_seq_len
        topk = torch.empty((num_tokens, layer.index_topk), dtype=torch.int32, device=kv_cache.device)
        rows_per_pass = max(1, min(num_tokens, self.score_buffer_bytes // (4 * row_len)))
        scores = torch.empty((rows_per_pass, row_len), dtype=torch.float32, device=kv_cache.device)
        for first_token in range(0, num_tokens, rows_per_pass):
            rows = min(rows_per_pass, num_tokens - first_token)
            self.indexer_scores(layer, indexer, kv_cache, metadata, scores, first_token, rows)
            self.select_topk(layer, scores, topk, metadata, first_token, rows)
        return topk

    def topk_slots(self, layer: MLALayerSpec, indexer: IndexerInputs, kv_cache: torch.Tensor,
                   metadata: AttentionMetadata) -> torch.Tensor:  # [num_tokens, index_topk] int32
        """``indexer_topk``'s lists with each key position replaced by its cache slot (what the
        attention kernels read: ``page * block_size + offset``), -1 kept."""
        topk = self.indexer_topk(layer, indexer, kv_cache, metadata)
        topk_slots_kernel[(metadata.num_tokens,)](
            topk, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, metadata.num_reqs,
            layer.index_topk, topk.stride(0), metadata.block_tables.stride(0),
            BLOCK_SIZE=kv_cache.shape[1], BLOCK_K=min(1024, triton.next_power_of_2(layer.index_topk)), num_warps=4,
        )
        return topk

    def indexer_scores(self, layer: MLALayerSpec, indexer: IndexerInputs, kv_cache: torch.Tensor,
                       metadata: AttentionMetadata, scores: torch.Tensor, first_token: int, rows: int) -> None:
        """Score rows [rows, max_seq_len] fp32 of tokens ``first_token ..`` over their causal prefix."""
        fp32 = kv_cache.dtype == torch.float32
        tiles = self.score_tiles_per_program
        heads_p = max(16, triton.next_power_of_2(layer.index_n_heads))
        if metadata.max_query_len >= self.block_scores_min_query_len:
            block = self.block_score_tiles or default_score_tiles(layer.index_n_heads, kv_cache.dtype)
            grid = (triton.cdiv(rows, block.block_t), triton.cdiv(scores.shape[1], block.block_n * tiles))
            indexer_block_scores_kernel[grid](
                indexer.q, indexer.weights, kv_cache, scores, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, metadata.num_reqs, first_token, rows,
                indexer.q.stride(0), indexer.q.stride(1), indexer.weights.stride(0), scores.stride(0),
                metadata.block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
                KEY_COL=layer.latent_dim, NUM_HEADS=layer.index_n_heads, HEADS_P=heads_p,
                HEAD_DIM=layer.index_head_dim, BLOCK_T=block.block_t, BLOCK_N=block.block_n, TILES=tiles,
                BLOCK_SIZE=kv_cache.shape[1], PRECISION="ieee" if fp32 else None,
                num_warps=block.num_warps, num_stages=block.num_stages,
            )
            return
        block_n = 64 if fp32 else 128
        indexer_scores_kernel[(rows, triton.cdiv(scores.shape[1], block_n * tiles))](
            indexer.q, indexer.weights, kv_cache, scores, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.num_reqs, first_token,
            indexer.q.stride(0), indexer.q.stride(1), indexer.weights.stride(0), scores.stride(0),
            metadata.block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
            KEY_COL=layer.latent_dim, NUM_HEADS=layer.index_n_heads,
            HEADS_P=heads_p, HEAD_DIM=layer.index_head_dim,
            BLOCK_N=block_n, TILES=tiles, BLOCK_SIZE=kv_cache.shape[1], PRECISION="ieee" if fp32 else None,
            num_warps=4, num_stages=3,
        )

    def select_topk(self, layer: MLALayerSpec, scores: torch.Tensor, topk: torch.Tensor, metadata: AttentionMetadata,
                    first_token: int, rows: int) -> None:
        """Top-k lists of tokens ``first_token ..`` from their score rows."""
        all_fit = metadata.max_seq_len <= self.topk_block
        topk_kernel[(rows,)](
            scores, topk, metadata.seq_lens, metadata.query_start_loc,
            metadata.num_reqs, first_token, layer.index_topk, scores.stride(0), topk.stride(0),
            BLOCK_S=self.topk_block, ALL_FIT=all_fit, COUNTING=self.topk_counting,
            # Streamed radix passes ran slower with 16 warps, so a launch that may stream takes 8
            # (its resident rows too: a CUDA graph's decode at max_model_len runs this variant).
            num_warps=self.topk_warps if all_fit else 8,
        )

    def layer_kernel(self, layer: MLALayerSpec) -> str:
        """The attention kernel of ``layer``'s shapes (what the plan sizes splits for): the chosen
        one, unless it is Gluon's and the shapes do not fit it."""
        return "wgmma" if self.attention_kernel == "wgmma" and wgmma_fits(layer) else "triton"

    def kernel_for(self, layer: MLALayerSpec, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> str:
        """The attention kernel these inputs run: the layer's, unless it is Gluon's and the dtypes
        (its copies move raw bytes: q must be the cache's dtype) or the rows' alignment do not
        suit it; then Triton's."""
        if self.layer_kernel(layer) == "wgmma" and q_lat.dtype == q_pe.dtype == kv_cache.dtype \
                and wgmma_aligned(q_lat, q_pe, kv_cache):
            return "wgmma"
        return "triton"

    def attend(self, layer: MLALayerSpec, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata, o_lat: torch.Tensor, plan: StepPlan,
               topk_slots: torch.Tensor | None) -> None:
        """o_lat [H, T, kv_lora_rank] from q_lat [H, T, kv_lora_rank] and q_pe (absorbed MQA);
        sparse plans attend to ``topk_slots`` (``topk_slots()``)."""
        num_tokens, lora = metadata.num_tokens, layer.kv_lora_rank
        kernel = self.kernel_for(layer, q_lat, q_pe, kv_cache)
        block_h, head_blocks = self.head_blocks(layer, kernel)
        split = plan.num_splits > 1
        if split:
            # Contiguous, so the lse buffer's offsets are the output buffer's divided by kv_lora_rank.
            partial_out = torch.empty((num_tokens, layer.num_heads, plan.num_splits, lora), dtype=torch.float32,
                                      device=q_lat.device)
            partial_lse = torch.empty((num_tokens, layer.num_heads, plan.num_splits), dtype=torch.float32,
                                      device=q_lat.device)
        else:
            partial_out = partial_lse = o_lat  # unused: SPLIT is off
        topk_list = topk_slots if topk_slots is not None else metadata.seq_lens  # any tensor when dense (unread)
        partial_strides = (partial_out.stride(0), partial_out.stride(1), partial_out.stride(2))
        args = (
            q_lat, q_pe, kv_cache, o_lat, partial_out, partial_lse,
            metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, topk_list,
            metadata.num_reqs, num_tokens, plan.num_splits, layer.index_topk, layer.scale * LOG2_E,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), o_lat.stride(0), o_lat.stride(1),
            metadata.block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1), topk_list.stride(0),
            *partial_strides,
        )
        grid = (num_tokens * head_blocks, plan.num_splits)
        shape = dict(NUM_HEADS=layer.num_heads, LORA=lora, ROPE=layer.qk_rope_head_dim, BLOCK_SIZE=kv_cache.shape[1],
                     SPARSE=plan.sparse, SPLIT=split)
        if kernel == "wgmma":
            wgmma_kernels.mla_attention_wgmma_kernel[grid](*args, **shape, num_warps=wgmma_kernels.NUM_WARPS)
        else:
            tiles = self.tiles()
            mla_attention_kernel[grid](
                *args, **shape, BLOCK_H=block_h, BLOCK_N=tiles.block_n,
                PRECISION="ieee" if kv_cache.dtype == torch.float32 else None,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            )
        if split:
            mla_reduce_kernel[(num_tokens, layer.num_heads)](
                o_lat, partial_out, partial_lse, plan.num_splits, o_lat.stride(0), o_lat.stride(1),
                *partial_strides, LORA=lora, NUM_SPLITS_P=triton.next_power_of_2(plan.num_splits), num_warps=4,
            )


def check_layer(layer: MLALayerSpec) -> None:
    """The kernels tile the latent, rope and indexer dims whole: powers of two from 16."""
    dims = {"kv_lora_rank": layer.kv_lora_rank, "qk_rope_head_dim": layer.qk_rope_head_dim}
    if layer.index_head_dim:  # a sparse layer with an indexer of its own
        dims["index_head_dim"] = layer.index_head_dim
    for name, dim in dims.items():
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"layer {layer.layer_idx}: the triton_mla backend needs {name} a power of two >= 16, "
                             f"got {dim}; choose another backend for this model")


def check_inputs(layer, q_nope, q_pe, kv_c, k_pe, kv_cache, w_uk, w_uv, indexer, block_size, selected=None) -> None:
    """The contract's shapes (``weir.mla.check_forward_inputs``), the shapes the kernels take, and
    unit last strides of everything they read; clear errors."""
    check_layer(layer)
    named = check_forward_inputs(layer, q_nope, q_pe, kv_c, k_pe, kv_cache, w_uk, w_uv, indexer, block_size, selected)
    for name, tensor in named.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"MLA layer {layer.layer_idx}: {name} must have a unit last stride, got {tensor.stride()}")
