"""Triton decode kernels of the paged attention backend: one query token per request.

One program per (request, kv head, KV split) handles all the q heads that share the kv head,
so each K/V tile is read once per group. With ``NUM_SPLITS_P > 1`` the key range is cut into
``num_splits`` pieces that write partial results (normalised output and base-2 log-sum-exp);
``decode_reduce_kernel`` merges them. Every length is read from device tensors, so a launch
depends only on host ints and can be captured in a CUDA graph.

With a sliding window (``SLIDING``) a request reads only its last ``min(seq_len, W)`` keys,
and the splits divide that range. Sinks (``HAS_SINKS``) join the denominator once: at the end
of the kernel without splits, in the reduce with them (the partials leave them out).
"""

from __future__ import annotations

import triton
import triton.language as tl

from weir.plugins.attention.triton_paged_kernels import (LOG2_E_CONST, NEG_BIG, fold_sinks, kv_tile_offsets,
                                                         online_softmax_step)


# The block-table stride is max_blocks_per_req: one variant for every max_model_len.
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"])
def decode_kernel(
    q_ptr, cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_splits, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
    stride_pr, stride_ph, stride_ps,  # partial_out [R, H, S, D]; partial_lse [R, H, S] shares them / D
    window, sinks_ptr,  # last, so the other parameters keep their offsets (full attention is unchanged)
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Attention of one query token per request, for the requests whose query_len is 1."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - token
    if query_len != 1:  # prefill requests of a mixed batch, or padding requests
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_keys = seq_len
    if SLIDING:  # tiles start at the window's first key: nothing before it (nor its page) is loaded
        kv_start = tl.maximum(seq_len - window, 0)
        num_keys = seq_len - kv_start
    num_tiles = tl.cdiv(num_keys, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    # Rows are the group's q heads, padded to GROUP_P >= 16 so tl.dot gets a legal tile.
    head_in_group = tl.arange(0, GROUP_P)
    head_valid = head_in_group < GROUP
    heads = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_valid[:, None], other=0.0)  # [G, D]

    m_i = tl.full([GROUP_P], NEG_BIG, tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    offsets_n = tl.arange(0, BLOCK_N)
    for kv_tile in range(first_tile, end_tile):
        keys = kv_tile * BLOCK_N + offsets_n
        if SLIDING:
            keys += kv_start
        key_mask = keys < seq_len
        pages = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
        rows_kv = kv_tile_offsets(pages, keys, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                                  BLOCK_SIZE)
        k = tl.load(cache_ptr + rows_kv[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
        v = tl.load(cache_ptr + stride_c_kv + rows_kv[:, None] + dims[None, :],
                    mask=key_mask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G, N]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, PRECISION)

    if HAS_SINKS:
        if not SPLIT:  # with splits, the reduce adds them once
            l_i, acc = fold_sinks(m_i, l_i, acc, sinks_ptr, heads, head_valid)
    # A split with no keys (short request) leaves l_i = 0: output 0 with weight exp2(NEG_BIG).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        partial = req.to(tl.int64) * stride_pr + heads * stride_ph + split * stride_ps  # [G]
        tl.store(partial_out_ptr + partial[:, None] + dims[None, :], out, mask=head_valid[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), NEG_BIG)
        tl.store(partial_lse_ptr + partial // HEAD_DIM, lse, mask=head_valid)
    else:
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, query_start_loc_ptr,
    num_splits, stride_ot, stride_oh, stride_pr, stride_ph, stride_ps, sinks_ptr,
    HEAD_DIM: tl.constexpr, NUM_SPLITS_P: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program per (request, q head): merge the splits' partial outputs by their weights
    (and the head's sink, a weight whose output is zero)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token != 1:
        return
    splits = tl.arange(0, NUM_SPLITS_P)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    partial = req.to(tl.int64) * stride_pr + head * stride_ph + splits * stride_ps  # [S]
    lse = tl.load(partial_lse_ptr + partial // HEAD_DIM, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2_E_CONST
        lse_max = tl.maximum(lse_max, sink)
    weights = tl.exp2(lse - lse_max)  # [S]; padded splits get 0
    outs = tl.load(partial_out_ptr + partial[:, None] + dims[None, :], mask=split_mask[:, None], other=0.0)
    numerator = tl.sum(outs * weights[:, None], axis=0)  # [D]
    denominator = tl.sum(weights, axis=0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - lse_max)
    merged = numerator / denominator
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
             merged.to(out_ptr.dtype.element_ty))
