"""Triton kernels of the MLA backend: the latent-cache store, attention over the latent (absorbed
form, dense or over a top-k list of keys) and the reduce of split-K partials.

The cache is ``[num_blocks, block_size, cache_dim]``: per token the ``LORA``-dim latent ``c``, the
``ROPE``-dim rope key, then (sparse layers) the indexer key. Token ``j`` of request ``r`` lives in
page ``block_tables[r, j // BLOCK_SIZE]`` at offset ``j % BLOCK_SIZE``.

Attention runs one program per (query token, block of ``BLOCK_H`` heads, key split). Every head
of a token reads the same latent rows, so a key tile ``[BLOCK_N, LORA + ROPE]`` is loaded once for
``BLOCK_H`` heads: the scores are ``q_lat . c + q_pe . k_pe`` (a ``[BLOCK_H, BLOCK_N]`` tile), the
value is ``c`` itself. One program per token (rather than a tile of tokens) costs nothing in
reuse, since ``BLOCK_H`` heads already fill the rows a register-resident ``[rows, LORA]``
accumulator allows, and it gives every token its exact causal key range (no masked waste).
Head blocks of one token are adjacent program ids, so the second reads the tile from L2.

Softmax runs in base 2 (``qk_scale`` holds ``log2(e)``) with fp32 statistics, as the paged
kernels do (``triton_paged_kernels``). Every length comes from device tensors and every grid
from host ints, so decode batches and mixed steps padded to fixed shapes can be captured in CUDA
graphs; a padded step's tokens past the last request have position -1 (``token_position``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from weir.plugins.attention.triton_paged_kernels import NEG_BIG, online_softmax_step


@triton.jit
def request_of_token(query_start_loc_ptr, token, num_reqs):
    """The request owning ``token``: the last r with ``query_start_loc[r] <= token`` (requests
    without tokens share their start with the next one, which is the owner)."""
    # Scalars derived from ``token`` rather than tl.zeros([]), which needs a layout in Gluon
    # kernels (mla_gluon_kernels calls this too).
    lo = token * 0
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = tl.load(query_start_loc_ptr + mid) <= token
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def token_position(query_start_loc_ptr, seq_lens_ptr, token, num_reqs):
    """``(request, position)`` of a query token: its position counts the request's cached prefix.
    A token past the last request's (a padded graph step's, owned by none) gets position -1: it
    sees no key, and its output row comes out zero."""
    req = request_of_token(query_start_loc_ptr, token, num_reqs)
    q_begin = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    owned = token < tl.load(query_start_loc_ptr + num_reqs)
    return req, tl.where(owned, seq_len - query_len + (token - q_begin), -1)


@triton.jit
def program_key_tiles(query_start_loc_ptr, seq_lens_ptr, num_reqs, num_tokens, num_splits, topk,
                      NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr):
    """An attention program's ``(token, head block, split, request, keys, first tile, end tile)``:
    its key tiles ``[first, end)`` of ``BLOCK_N`` over the token's causal prefix (sparse: the first
    ``min(topk, position + 1)`` entries of its list). Scalars only, so the Gluon kernel calls it too."""
    HEAD_BLOCKS: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    # Highest tokens first: in a prefill they see the most keys, so they start early.
    token = num_tokens - 1 - tl.program_id(0) // HEAD_BLOCKS
    head_block = tl.program_id(0) % HEAD_BLOCKS
    split = tl.program_id(1)
    req, position = token_position(query_start_loc_ptr, seq_lens_ptr, token, num_reqs)
    num_keys = tl.maximum(position + 1, 0)  # a padding request (seq_len 0) sees no key
    if SPARSE:
        num_keys = tl.minimum(num_keys, topk)
    num_tiles = tl.cdiv(num_keys, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)
    return token, head_block, split, req, num_keys, first_tile, end_tile


@triton.jit
def store_latent_kernel(
    kv_c_ptr, k_pe_ptr, index_k_ptr, cache_ptr, slot_mapping_ptr,
    stride_ct, stride_pt, stride_it, stride_c_block, stride_c_offset,
    LORA: tl.constexpr, ROPE: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_INDEXER: tl.constexpr, COLS_P: tl.constexpr,
):
    """One program per token: its latent, rope key (and indexer key) into one cache row; a
    token with slot < 0 (padding) stores nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    # A column bound instead of a scalar branch: the interpreter mis-types a scalar condition
    # combined with a vector mask (see triton_kv_store).
    num_cols = LORA + ROPE + INDEX_DIM
    stored_cols = tl.where(slot >= 0, num_cols, 0)
    cols = tl.arange(0, COLS_P)
    in_row = cols < stored_cols
    is_latent = cols < LORA
    is_rope = (cols >= LORA) & (cols < LORA + ROPE)
    values = tl.load(kv_c_ptr + token * stride_ct + cols, mask=in_row & is_latent, other=0.0)
    rope = tl.load(k_pe_ptr + token * stride_pt + (cols - LORA), mask=in_row & is_rope, other=0.0)
    values = tl.where(is_rope, rope.to(values.dtype), values)
    if HAS_INDEXER:
        is_index = cols >= LORA + ROPE
        index_k = tl.load(index_k_ptr + token * stride_it + (cols - LORA - ROPE), mask=in_row & is_index, other=0.0)
        values = tl.where(is_index, index_k.to(values.dtype), values)
    slot = tl.maximum(slot, 0)
    row = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_offset
    tl.store(cache_ptr + row + cols, values.to(cache_ptr.dtype.element_ty), mask=in_row)


# Batch sizes vary every step: no value specialisation, so no compile in the middle of a run.
@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_splits", "stride_bt", "topk"])
def mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, o_lat_ptr, partial_out_ptr, partial_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, topk_ptr,
    num_reqs, num_tokens, num_splits, topk, qk_scale,
    stride_qlh, stride_qlt, stride_qpt, stride_qph, stride_olh, stride_olt, stride_bt,
    stride_c_block, stride_c_offset, stride_kt,
    stride_pt, stride_ph, stride_ps,  # partial_out [T, H, S, LORA]; partial_lse [T, H, S] shares them / LORA
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPARSE: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Absorbed MLA for one query token and ``BLOCK_H`` heads over its causal prefix (dense) or
    over the first ``min(topk, position + 1)`` entries of its top-k list (``SPARSE``: cache slots,
    ``topk_slots_kernel``'s; -1 = none).

    q_lat [H, T, LORA] (W_UK folded in), q_pe [T, H, ROPE]; writes o_lat [H, T, LORA] (the
    softmax-weighted latent), or with ``SPLIT`` one normalised partial and its base-2 lse per
    key split, which ``mla_reduce_kernel`` merges.
    """
    token, head_block, split, req, num_keys, first_tile, end_tile = program_key_tiles(
        query_start_loc_ptr, seq_lens_ptr, num_reqs, num_tokens, num_splits, topk, NUM_HEADS, BLOCK_H, BLOCK_N, SPARSE)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < NUM_HEADS
    lora = tl.arange(0, LORA)
    rope = tl.arange(0, ROPE)
    token64 = token.to(tl.int64)
    q_lat = tl.load(q_lat_ptr + heads[:, None].to(tl.int64) * stride_qlh + token64 * stride_qlt + lora[None, :],
                    mask=head_valid[:, None], other=0.0)  # [BH, LORA]
    q_pe = tl.load(q_pe_ptr + token64 * stride_qpt + heads[:, None] * stride_qph + rope[None, :],
                   mask=head_valid[:, None], other=0.0)  # [BH, ROPE]
    q_lat = q_lat.to(cache_ptr.dtype.element_ty)
    q_pe = q_pe.to(cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA], tl.float32)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    offsets_n = tl.arange(0, BLOCK_N)
    for kv_tile in range(first_tile, end_tile):
        entries = kv_tile * BLOCK_N + offsets_n  # key positions (dense) or top-k list entries
        key_mask = entries < num_keys
        if SPARSE:  # the list's entries are cache slots of this request's keys, compacted to the front
            cache_slots = tl.load(topk_ptr + token64 * stride_kt + entries, mask=key_mask, other=-1)
            key_mask = cache_slots >= 0
            cache_slots = tl.maximum(cache_slots, 0)
            pages, in_page = cache_slots // BLOCK_SIZE, cache_slots % BLOCK_SIZE
        else:
            pages = tl.load(table_row + entries // BLOCK_SIZE, mask=key_mask, other=0)
            in_page = entries % BLOCK_SIZE
        rows = pages.to(tl.int64) * stride_c_block + in_page * stride_c_offset  # [N]
        latent = tl.load(cache_ptr + rows[:, None] + lora[None, :], mask=key_mask[:, None], other=0.0)  # [N, LORA]
        k_pe = tl.load(cache_ptr + rows[:, None] + LORA + rope[None, :], mask=key_mask[:, None], other=0.0)
        scores = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), acc=scores, input_precision=PRECISION) * qk_scale  # [BH, N]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, latent, m_i, l_i, acc, PRECISION)

    # A split (or a padding request) with no keys leaves l_i = 0: output 0, weight exp2(NEG_BIG).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        partial = token64 * stride_pt + heads * stride_ph + split * stride_ps  # [BH]
        tl.store(partial_out_ptr + partial[:, None] + lora[None, :], out, mask=head_valid[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), NEG_BIG)
        tl.store(partial_lse_ptr + partial // LORA, lse, mask=head_valid)
    else:
        tl.store(o_lat_ptr + heads[:, None].to(tl.int64) * stride_olh + token64 * stride_olt + lora[None, :],
                 out.to(o_lat_ptr.dtype.element_ty), mask=head_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def mla_reduce_kernel(
    o_lat_ptr, partial_out_ptr, partial_lse_ptr, num_splits,
    stride_olh, stride_olt, stride_pt, stride_ph, stride_ps,
    LORA: tl.constexpr, NUM_SPLITS_P: tl.constexpr,
):
    """One program per (token, head): merge the splits' partial latents by their weights."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS_P)
    split_mask = splits < num_splits
    base = token * stride_pt + head * stride_ph
    lse = tl.load(partial_lse_ptr + (base + splits * stride_ps) // LORA, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weights = tl.exp2(lse - lse_max)  # [S]; padded splits get 0
    denominator = tl.sum(weights, axis=0)
    lora = tl.arange(0, LORA)
    merged = tl.zeros([LORA], tl.float32)
    # One split at a time keeps a [LORA] accumulator, not [S, LORA] registers.
    for split in range(0, num_splits):
        weight = tl.exp2(tl.load(partial_lse_ptr + (base + split * stride_ps) // LORA) - lse_max)
        merged += weight * tl.load(partial_out_ptr + base + split * stride_ps + lora)
    merged = merged / denominator
    tl.store(o_lat_ptr + head.to(tl.int64) * stride_olh + token * stride_olt + lora,
             merged.to(o_lat_ptr.dtype.element_ty))
