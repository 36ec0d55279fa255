"""Triton kernels of DSA's lightning indexer: per-query scores over the cached indexer keys, and
the top-k selection of the keys each query attends to.

``indexer_scores_kernel``: one program per (query token, tile of ``BLOCK_N`` keys) of the token's
causal prefix: ``score(t, j) = sum_g w(t, g) * relu(q(t, g) . k_j)``, the ``[BLOCK_N, heads]``
dot done once for all heads of the token; fp32 scores go to a ``[rows, max_seq_len]`` buffer.
``indexer_block_scores_kernel``: the same for a block of consecutive query tokens (prefill),
sharing each key tile among them.

``topk_kernel``: one program per query token picks the ``topk`` highest scores of its row
(``position + 1`` entries) without sorting. It finds the k-th largest score exactly, on the
scores' bits mapped to order-preserving int32 keys: a row that fits in registers bisects the
int32 range (32 counts of the keys at or above a candidate); a longer row streams through a
radix select (4 passes of an 8-bit histogram over the keys still in the running, each fixing one
byte of the k-th largest). One pass then writes the positions above it and, in position order,
as many equal to it as the count still needs. The list comes out in ascending
key position (good for the attention's page locality), -1 past ``min(topk, position + 1)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from weir.plugins.attention.mla_triton_kernels import token_position


@triton.jit(do_not_specialize=["num_reqs", "first_token", "stride_bt"])
def indexer_scores_kernel(
    q_ptr, weights_ptr, cache_ptr, scores_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_reqs, first_token,
    stride_qt, stride_qh, stride_wt, stride_sr, stride_bt, stride_c_block, stride_c_offset,
    KEY_COL: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Scores of row ``program_id(0)`` (token ``first_token + row``) for ``TILES`` key tiles.

    q [T, NUM_HEADS, HEAD_DIM], weights [T, NUM_HEADS] fp32; the keys are cache columns
    ``KEY_COL .. KEY_COL + HEAD_DIM``. Entries past the token's position are left unwritten.
    The dot is taken keys first, ``[N, G] = k . q^T``: each key's sum over the heads is then a
    row of the accumulator, held by one thread and its lane group, where ``q . k^T`` summed a
    column across warps (faster on an H200 in prefill and decode alike: bench_mla's numbers are
    in the results).
    """
    row = tl.program_id(0)
    token = first_token + row
    req, position = token_position(query_start_loc_ptr, seq_lens_ptr, token, num_reqs)
    first_tile = tl.program_id(1) * TILES
    end_tile = tl.minimum(first_tile + TILES, tl.cdiv(position + 1, BLOCK_N))
    if first_tile >= end_tile:
        return
    dims = tl.arange(0, HEAD_DIM)
    heads = tl.arange(0, HEADS_P)
    head_valid = heads < NUM_HEADS
    token64 = token.to(tl.int64)
    q = tl.load(q_ptr + token64 * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_valid[:, None],
                other=0.0).to(cache_ptr.dtype.element_ty)  # [G, D]
    w = tl.load(weights_ptr + token64 * stride_wt + heads, mask=head_valid, other=0.0)  # [G] fp32
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    score_row = scores_ptr + row.to(tl.int64) * stride_sr
    for key_tile in range(first_tile, end_tile):
        keys = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_mask = keys <= position
        pages = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
        rows = pages.to(tl.int64) * stride_c_block + (keys % BLOCK_SIZE) * stride_c_offset + KEY_COL  # [N]
        k = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)  # [N, D]
        logits = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [N, G]
        tl.store(score_row + keys, tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1), mask=key_mask)


@triton.jit(do_not_specialize=["num_reqs", "first_token", "rows", "stride_bt"])
def indexer_block_scores_kernel(
    q_ptr, weights_ptr, cache_ptr, scores_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_reqs, first_token, rows,
    stride_qt, stride_qh, stride_wt, stride_sr, stride_bt, stride_c_block, stride_c_offset,
    KEY_COL: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``indexer_scores_kernel`` for ``BLOCK_T`` consecutive rows at once (prefill): each key
    tile is loaded once for all of them, one ``[BLOCK_N, BLOCK_T * heads]`` dot, where the
    one-token kernel loads it once per token. Rows ``program_id(0) * BLOCK_T ..`` (of ``rows``)
    may belong to different requests, whose keys differ: the tiles run once per request among them
    (one, except at a request's boundary), each time for that request's rows alone."""
    first_row = tl.program_id(0) * BLOCK_T
    block_rows = tl.arange(0, BLOCK_T)
    reqs = tl.zeros([BLOCK_T], tl.int32)
    positions = tl.full([BLOCK_T], -1, tl.int32)  # -1: a row past ``rows`` or owned by no request
    for block_row in tl.static_range(BLOCK_T):
        req, position = token_position(query_start_loc_ptr, seq_lens_ptr, first_token + first_row + block_row, num_reqs)
        in_pass = first_row + block_row < rows
        reqs = tl.where(block_rows == block_row, req, reqs)
        positions = tl.where(block_rows == block_row, tl.where(in_pass, position, -1), positions)
    first_req = tl.min(tl.where(positions >= 0, reqs, num_reqs), axis=0)
    last_req = tl.max(tl.where(positions >= 0, reqs, -1), axis=0)

    # Column c of the dot is head c % HEADS_P of row c // HEADS_P.
    columns = tl.arange(0, BLOCK_T * HEADS_P)
    column_row = columns // HEADS_P
    column_head = columns % HEADS_P
    dims = tl.arange(0, HEAD_DIM)
    tokens64 = (first_token + first_row + column_row).to(tl.int64)
    column_valid = (column_head < NUM_HEADS) & (first_row + column_row < rows)
    q = tl.load(q_ptr + tokens64[:, None] * stride_qt + column_head[:, None] * stride_qh + dims[None, :],
                mask=column_valid[:, None], other=0.0).to(cache_ptr.dtype.element_ty)  # [T * G, D]
    w = tl.load(weights_ptr + tokens64 * stride_wt + column_head, mask=column_valid, other=0.0)  # [T * G] fp32
    score_rows = scores_ptr + (first_row + block_rows).to(tl.int64) * stride_sr  # [T]
    first_tile = tl.program_id(1) * TILES
    for req_offset in range(0, last_req + 1 - first_req):
        req = first_req + req_offset  # a tensor, also in the interpreter (a range yields ints)
        in_req = (reqs == req) & (positions >= 0)  # [T]
        last_position = tl.max(tl.where(in_req, positions, -1), axis=0)
        end_tile = tl.minimum(first_tile + TILES, tl.cdiv(last_position + 1, BLOCK_N))
        table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
        for key_tile in range(first_tile, end_tile):
            keys = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_mask = keys <= last_position
            pages = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
            offsets = pages.to(tl.int64) * stride_c_block + (keys % BLOCK_SIZE) * stride_c_offset + KEY_COL  # [N]
            k = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)  # [N, D]
            logits = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [N, T * G]
            weighted = tl.reshape(tl.maximum(logits, 0.0) * w[None, :], [BLOCK_N, BLOCK_T, HEADS_P])
            row_scores = tl.sum(weighted, axis=2)  # [N, T]
            store_mask = in_req[None, :] & (keys[:, None] <= positions[None, :])
            tl.store(score_rows[None, :] + keys[:, None], row_scores, mask=store_mask)


@triton.jit
def sortable_key(scores):
    """fp32 -> int32 whose signed order is the scores' order (negative floats flip their
    magnitude bits)."""
    bits = scores.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def byte_histogram(keys, valid, prefix, PASS: tl.constexpr):
    """Histogram of byte ``PASS`` (most significant first) of the valid keys whose higher bytes
    equal ``prefix`` (every valid key on pass 0)."""
    SHIFT: tl.constexpr = 24 - 8 * PASS
    if PASS == 0:
        digits = (keys >> 24) + 128  # the signed top byte, shifted to 0..255
        in_running = valid
    else:
        digits = (keys >> SHIFT) & 255
        in_running = valid & ((keys >> (SHIFT + 8)) == prefix)
    return tl.histogram(digits, 256, mask=in_running)


@triton.jit
def row_histogram(scores_row, num_keys, prefix, resident, PASS: tl.constexpr, BLOCK_S: tl.constexpr,
                  RESIDENT: tl.constexpr):
    """``byte_histogram`` over the whole row: the resident keys (``RESIDENT``) or block by block."""
    offsets = tl.arange(0, BLOCK_S)
    if RESIDENT:
        hist = byte_histogram(resident, offsets < num_keys, prefix, PASS)
    else:
        hist = tl.zeros([256], tl.int32)
        for start in range(0, num_keys, BLOCK_S):
            valid = start + offsets < num_keys
            keys = sortable_key(tl.load(scores_row + start + offsets, mask=valid, other=0.0))
            hist += byte_histogram(keys, valid, prefix, PASS)
    return hist


@triton.jit
def keep_block(out_row, positions, keys, valid, threshold, wanted, kept, equal_seen):
    """Write the block's kept positions after the ``kept`` already written: keys above the
    threshold, and equal ones while fewer than ``wanted`` equal ones were seen."""
    equal = (valid & (keys == threshold)).to(tl.int32)
    equal_rank = equal_seen + tl.cumsum(equal, axis=0) - equal
    keep = ((valid & (keys > threshold)) | ((equal > 0) & (equal_rank < wanted))).to(tl.int32)
    destination = kept + tl.cumsum(keep, axis=0) - keep
    tl.store(out_row + destination, positions, mask=keep > 0)
    return kept + tl.sum(keep, axis=0), equal_seen + tl.sum(equal, axis=0)


@triton.jit
def kth_largest_by_radix(scores_row, num_keys, resident, topk, BLOCK_S: tl.constexpr, RESIDENT: tl.constexpr):
    """``(k-th largest key, how many keys equal to it belong to the top k)``, a byte a pass."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int32)
    wanted = tl.zeros([], tl.int32) + topk  # how many of the keys still in the running to keep
    for PASS in tl.static_range(4):
        hist = row_histogram(scores_row, num_keys, prefix, resident, PASS, BLOCK_S, RESIDENT)
        at_or_above = tl.cumsum(hist, axis=0, reverse=True)  # [256] keys with this byte or a higher one
        chosen = tl.max(tl.where(at_or_above >= wanted, bins, 0), axis=0)  # the k-th largest's byte
        wanted -= tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
        if PASS == 0:
            prefix = chosen - 128
        else:
            prefix = (prefix << 8) | chosen
    return prefix, wanted


@triton.jit
def kth_largest_by_counting(keys, valid, topk):
    """The same by bisection over the int32 range: the largest t with ``count(keys >= t) >= topk``."""
    lo = tl.zeros([], tl.int64) - 2 ** 31
    hi = tl.zeros([], tl.int64) + 2 ** 31 - 1
    for _ in tl.static_range(32):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((valid & (keys >= mid.to(tl.int32))).to(tl.int32), axis=0) >= topk
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    threshold = lo.to(tl.int32)
    return threshold, topk - tl.sum((valid & (keys > threshold)).to(tl.int32), axis=0)


@triton.jit
def topk_of_resident_row(scores_row, out_row, num_keys, topk, BLOCK_S: tl.constexpr, COUNTING: tl.constexpr):
    """A row of at most ``BLOCK_S`` keys, held in registers through every pass."""
    offsets = tl.arange(0, BLOCK_S)
    valid = offsets < num_keys
    keys = sortable_key(tl.load(scores_row + offsets, mask=valid, other=0.0))  # [BLOCK_S]
    if COUNTING:
        threshold, wanted = kth_largest_by_counting(keys, valid, topk)
    else:
        threshold, wanted = kth_largest_by_radix(scores_row, num_keys, keys, topk, BLOCK_S, True)
    keep_block(out_row, offsets, keys, valid, threshold, wanted, tl.zeros([], tl.int32), tl.zeros([], tl.int32))


@triton.jit
def topk_of_streamed_row(scores_row, out_row, num_keys, topk, BLOCK_S: tl.constexpr):
    """A longer row, streamed in ``BLOCK_S`` blocks by every pass (from L2: it was just written)."""
    threshold, wanted = kth_largest_by_radix(scores_row, num_keys, tl.zeros([BLOCK_S], tl.int32), topk, BLOCK_S,
                                             False)
    kept = tl.zeros([], tl.int32)
    equal_seen = tl.zeros([], tl.int32)
    offsets = tl.arange(0, BLOCK_S)
    for start in range(0, num_keys, BLOCK_S):
        valid = start + offsets < num_keys
        keys = sortable_key(tl.load(scores_row + start + offsets, mask=valid, other=0.0))
        kept, equal_seen = keep_block(out_row, start + offsets, keys, valid, threshold, wanted, kept, equal_seen)


@triton.jit(do_not_specialize=["num_reqs", "first_token", "topk"])
def topk_kernel(
    scores_ptr, topk_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_reqs, first_token, topk, stride_sr, stride_kt,
    BLOCK_S: tl.constexpr, ALL_FIT: tl.constexpr, COUNTING: tl.constexpr,
):
    """Row ``program_id(0)``'s top-``topk`` key positions into ``topk[first_token + row]``.

    A row that fits in one ``BLOCK_S`` block stays in registers for every pass; a longer one is
    streamed in blocks. ``ALL_FIT``: every row of the step fits (the step's longest sequence
    does), so only the resident path is compiled; otherwise each row takes its own path, as a
    CUDA graph's step must, whose longest sequence is baked at the graph's bound. ``COUNTING``
    (resident rows only): bisect the threshold with 32 counts instead of 4 histograms.
    """
    row = tl.program_id(0)
    token = first_token + row
    _, position = token_position(query_start_loc_ptr, seq_lens_ptr, token, num_reqs)
    num_keys = tl.maximum(position + 1, 0)
    out_row = topk_ptr + (token.to(tl.int64)) * stride_kt
    if num_keys <= topk:  # every key is kept
        for chunk in range(0, tl.cdiv(topk, BLOCK_S)):
            offsets = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
            tl.store(out_row + offsets, tl.where(offsets < num_keys, offsets, -1), mask=offsets < topk)
        return

    scores_row = scores_ptr + row.to(tl.int64) * stride_sr
    if ALL_FIT:  # the same call as below, but the streamed path is not compiled into this variant
        topk_of_resident_row(scores_row, out_row, num_keys, topk, BLOCK_S, COUNTING)
    elif num_keys <= BLOCK_S:
        topk_of_resident_row(scores_row, out_row, num_keys, topk, BLOCK_S, COUNTING)
    else:
        topk_of_streamed_row(scores_row, out_row, num_keys, topk, BLOCK_S)


@triton.jit(do_not_specialize=["num_reqs", "topk", "stride_bt"])
def topk_slots_kernel(
    topk_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_reqs, topk, stride_kt, stride_bt,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Token ``program_id(0)``'s top-k key positions, in place, into cache slots
    (``page * BLOCK_SIZE + offset``; -1 stays -1): the attention kernels then gather each key row
    with one load ahead of it, not a position load and a page-table load."""
    token = tl.program_id(0)
    req, _ = token_position(query_start_loc_ptr, seq_lens_ptr, token, num_reqs)
    row = topk_ptr + token.to(tl.int64) * stride_kt
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(0, topk, BLOCK_K):
        offsets = start + tl.arange(0, BLOCK_K)
        in_row = offsets < topk
        keys = tl.load(row + offsets, mask=in_row, other=-1)
        valid = keys >= 0
        pages = tl.load(table_row + tl.maximum(keys, 0) // BLOCK_SIZE, mask=valid, other=0)
        tl.store(row + offsets, tl.where(valid, pages * BLOCK_SIZE + keys % BLOCK_SIZE, -1), mask=in_row)
