"""Triton kernels of the paged attention backend: shared tile helpers and the varlen prefill.

The cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; kernels take its strides,
so K and V are the two halves of one tensor. Key ``j`` of request ``r`` lives in page
``block_tables[r, j // BLOCK_SIZE]`` at offset ``j % BLOCK_SIZE``; every key tile is gathered
page by page through the block table, so a tile may span several pages (or part of one).

Softmax runs in base 2 (``qk_scale`` already holds ``log2(e)``) with fp32 statistics. Running
maxima start at a large finite negative instead of ``-inf`` so that a row whose keys are all
masked in a tile never computes ``-inf - -inf``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # "minus infinity" that stays finite under subtraction


@triton.jit
def kv_tile_offsets(pages, keys, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                    BLOCK_SIZE: tl.constexpr):
    """Element offset of each key's row (one kv head) in the cache: ``[BLOCK_N]`` int64.

    pages: the block-table entries of ``keys`` (``[BLOCK_N]``, loaded by the caller).
    """
    return pages.to(tl.int64) * stride_c_block + (keys % BLOCK_SIZE) * stride_c_offset + kv_head * stride_c_head


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one key tile into the running (max, sum, weighted values) of every query row.

    scores: [M, N] fp32 already scaled to base 2 and masked with -inf; v: [N, D].
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def find_request(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning query tile ``tile_id``; request r's tiles start at qsl[r] // BLOCK_Q + r.

    That numbering gives every request at least as many tile ids as it needs while the total
    stays below num_tokens // BLOCK_Q + num_reqs, a bound the host knows without a sync.
    """
    # Explicit int32 scalars: loop-carried values must keep one type (num_reqs == 1 is constexpr).
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(mid_start <= tile_id, mid, lo)
        hi = tl.where(mid_start <= tile_id, hi, mid - 1)
    return lo


# Batch sizes vary every step: no value specialisation, so no compile in the middle of a run.
# The block-table stride is max_blocks_per_req: one variant for every max_model_len.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def prefill_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_reqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Causal attention for requests with query_len >= 2 (query_len 1 goes to the decode kernel).

    One program per (query tile, kv head). Its BLOCK_Q tokens times the GROUP q heads sharing
    the kv head form the BLOCK_M = BLOCK_Q * GROUP_P rows of one tile, so each K/V tile is
    loaded once for the whole group. Key tiles that every row may see run unmasked; only the
    tail that crosses the causal diagonal is masked.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    # Highest tile ids first: the last tiles of a request see the most keys, so they start early.
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    req = find_request(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    tile_start = (tile_id - (q_begin // BLOCK_Q + req)) * BLOCK_Q  # first query index of this tile
    if (query_len < 2) | (tile_start >= query_len):
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_idx = tile_start + rows // GROUP_P  # [M] index within the request's queries
    head_in_group = rows % GROUP_P
    row_valid = (query_idx < query_len) & (head_in_group < GROUP)
    heads = kv_head * GROUP + head_in_group
    tokens = (q_begin + query_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0)  # [M, D]
    row_pos = context_len + query_idx  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    offsets_n = tl.arange(0, BLOCK_N)

    # Keys up to the tile's first position are visible to every row.
    num_full_tiles = (context_len + tile_start + 1) // BLOCK_N
    for kv_tile in range(0, num_full_tiles):
        keys = kv_tile * BLOCK_N + offsets_n
        pages = tl.load(table_row + keys // BLOCK_SIZE)
        rows_kv = kv_tile_offsets(pages, keys, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                                  BLOCK_SIZE)
        k = tl.load(cache_ptr + rows_kv[:, None] + dims[None, :])  # [N, D]
        v = tl.load(cache_ptr + stride_c_kv + rows_kv[:, None] + dims[None, :])
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)

    kv_end = tl.minimum(seq_len, context_len + tile_start + BLOCK_Q)  # one past the last visible key
    for kv_tile in range(num_full_tiles, tl.cdiv(kv_end, BLOCK_N)):
        keys = kv_tile * BLOCK_N + offsets_n
        key_mask = keys < kv_end
        pages = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
        rows_kv = kv_tile_offsets(pages, keys, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                                  BLOCK_SIZE)
        k = tl.load(cache_ptr + rows_kv[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
        v = tl.load(cache_ptr + stride_c_kv + rows_kv[:, None] + dims[None, :],
                    mask=key_mask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (keys[None, :] <= row_pos[:, None]) & key_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
