"""Triton kernels of the paged attention backend: shared tile helpers and the varlen prefill.

The cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; kernels take its strides,
so K and V are the two halves of one tensor. Key ``j`` of request ``r`` lives in page
``block_tables[r, j // BLOCK_SIZE]`` at offset ``j % BLOCK_SIZE``; every key tile is gathered
page by page through the block table, so a tile may span several pages (or part of one).

Softmax runs in base 2 (``qk_scale`` already holds ``log2(e)``) with fp32 statistics. Running
maxima start at a large finite negative instead of ``-inf`` so that a row whose keys are all
masked in a tile never computes ``-inf - -inf``.

Sliding windows (``SLIDING``, runtime ``window`` W: the query at position p sees keys
``p - W + 1 .. p``) and sinks (``HAS_SINKS``: one extra logit per q head in the denominator,
folded in after the last key tile) are constexpr flags, so full-attention layers compile to
the same code as without them. Keys before a window are never loaded, nor their block-table
entries: those blocks may already belong to another request.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
LOG2_E_CONST = tl.constexpr(LOG2_E)  # the same, readable inside kernels
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
def fold_sinks(m_i, l_i, acc, sinks_ptr, heads, head_valid):
    """Add each row's sink logit (natural-log units, as the model's ``sinks``) to its softmax
    denominator; its value row is zero, so only the normaliser and the rescaled acc change.

    Returns ``(l_i, acc)`` on the new running maximum ``max(m_i, sink)``, which stays exact for
    large sinks and for rows that saw no key (``m_i = NEG_BIG``).
    """
    sink = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0).to(tl.float32) * LOG2_E_CONST  # [M]
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.exp2(sink - m_new)
    return l_i, acc * alpha[:, None]


@triton.jit
def attend_masked_tile(q, m_i, l_i, acc, cache_ptr, table_row, kv_tile, row_pos, kv_lo, kv_end, window,
                       kv_head, qk_scale, dims, stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
                       BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLIDING: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Fold one key tile whose keys some rows may not see: causally, outside ``[kv_lo, kv_end)``,
    or (``SLIDING``) before a row's window. Keys outside ``[kv_lo, kv_end)`` are not loaded."""
    keys = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    key_mask = keys < kv_end
    if SLIDING:
        key_mask = key_mask & (keys >= kv_lo)
    pages = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
    rows_kv = kv_tile_offsets(pages, keys, kv_head, stride_c_block, stride_c_offset, stride_c_head, BLOCK_SIZE)
    k = tl.load(cache_ptr + rows_kv[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
    v = tl.load(cache_ptr + stride_c_kv + rows_kv[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
    visible = (keys[None, :] <= row_pos[:, None]) & key_mask[None, :]
    if SLIDING:
        visible = visible & (keys[None, :] > row_pos[:, None] - window)
    scores = tl.where(visible, scores, float("-inf"))
    return online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)


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
@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "window"])
def prefill_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_reqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
    window, sinks_ptr,  # last, so the other parameters keep their offsets (full attention is unchanged)
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Causal attention for requests with query_len >= 2 (query_len 1 goes to the decode kernel).

    One program per (query tile, kv head). Its BLOCK_Q tokens times the GROUP q heads sharing
    the kv head form the BLOCK_M = BLOCK_Q * GROUP_P rows of one tile, so each K/V tile is
    loaded once for the whole group. Key tiles that every row may see run unmasked; only the
    tail that crosses the causal diagonal is masked, and with a window, the head that crosses
    the window's start (tiles wholly before the first row's window are skipped).
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
    first_pos = context_len + tile_start  # the tile's first row position

    # Keys up to the tile's first position are visible to every row (and, with a window, from
    # the last row's window start on): those tiles run unmasked.
    full_start = 0
    full_end = (first_pos + 1) // BLOCK_N
    kv_lo = 0
    if SLIDING:
        kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # also set below, where full attention has it
        kv_lo = tl.maximum(first_pos - window + 1, 0)  # the first row's window start
        first_tile = kv_lo // BLOCK_N
        full_start = tl.maximum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N), first_tile)
        full_end = tl.maximum(full_end, full_start)
        for kv_tile in range(first_tile, full_start):
            m_i, l_i, acc = attend_masked_tile(
                q, m_i, l_i, acc, cache_ptr, table_row, kv_tile, row_pos, kv_lo, kv_end, window, kv_head,
                qk_scale, dims, stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
                BLOCK_N, BLOCK_SIZE, SLIDING, PRECISION)

    for kv_tile in range(full_start, full_end):
        keys = kv_tile * BLOCK_N + offsets_n
        pages = tl.load(table_row + keys // BLOCK_SIZE)
        rows_kv = kv_tile_offsets(pages, keys, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                                  BLOCK_SIZE)
        k = tl.load(cache_ptr + rows_kv[:, None] + dims[None, :])  # [N, D]
        v = tl.load(cache_ptr + stride_c_kv + rows_kv[:, None] + dims[None, :])
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)

    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # one past the last visible key
    for kv_tile in range(full_end, tl.cdiv(kv_end, BLOCK_N)):
        m_i, l_i, acc = attend_masked_tile(
            q, m_i, l_i, acc, cache_ptr, table_row, kv_tile, row_pos, kv_lo, kv_end, window, kv_head,
            qk_scale, dims, stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
            BLOCK_N, BLOCK_SIZE, SLIDING, PRECISION)

    if HAS_SINKS:
        l_i, acc = fold_sinks(m_i, l_i, acc, sinks_ptr, heads, row_valid)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def zero_unowned_rows_kernel(out_ptr, query_start_loc_ptr, num_reqs, num_tokens, stride_t,
                             ROW_ELEMS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zero the rows of ``out`` [num_tokens, ROW_ELEMS] (unit stride within a row) from token
    ``query_start_loc[num_reqs]`` on: the tokens of a padded graph step that belong to no
    request, which no attention kernel writes. Programs over owned rows only read the bound."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    first_unowned = tl.load(query_start_loc_ptr + num_reqs)
    unowned = (rows >= first_unowned) & (rows < num_tokens)
    if tl.max(unowned.to(tl.int32), axis=0) == 0:
        return
    base = out_ptr + rows[:, None].to(tl.int64) * stride_t
    for start in range(0, ROW_ELEMS, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        tl.store(base + cols[None, :], tl.zeros([BLOCK_T, BLOCK_C], out_ptr.dtype.element_ty),
                 mask=unowned[:, None] & (cols[None, :] < ROW_ELEMS))
