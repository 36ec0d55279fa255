"""Triton kernels that build one step's inputs from the persistent request table.

The torch versions in ``weir.runner.inputs`` and ``weir.buffers.staged_write`` are the oracles;
each ``*_triton`` function here has the same signature and results. Grids come from host
integers only (tensor shapes and the ``num_tokens`` the runner passes), never from device
values, so nothing here synchronises and every launch can be captured in a CUDA graph.

Padding convention (a CUDA-graph batch padded to a captured size of ``B`` requests and ``T``
tokens):
  - a padding request has ``idx_mapping[r] == -1``: it reads no table row, gets
    ``seq_lens[r] == 0``, a block-table row of zeros (the reserved null block), slot -1 for
    any token it owns (``compute_slot_mapping``, which sees only the gathered table, puts them
    in the null block instead), and ``post_update`` leaves the table untouched for it;
  - ``query_start_loc`` is non-decreasing; padding requests usually repeat the previous entry
    (no tokens), but may own tokens;
  - tokens ``t >= query_start_loc[B]`` belong to no request: ``input_ids`` and ``positions``
    are 0 there and ``slot_mapping`` is -1 (``token_to_request`` says ``B``).
A spare all-zero table row used as the padding requests' row works too (their tokens then read
token 0 at positions from 0 and land in the null block), as long as ``post_update`` only gets
the real requests, since it would advance that row. ``query_start_loc`` may be longer than
``B + 1`` (a static buffer): only its first ``B + 1`` entries are read (``token_to_request``
excepted: it takes ``B`` from that length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOKEN_BLOCK = 256  # query tokens one program handles per loop step
REQ_BLOCK = 128  # requests per program in post_update
SCATTER_BLOCK = 1024
# Batch sizes change every step: compiling variants for 1 and multiples of 16 would only add
# start-up compiles.
DYNAMIC_SIZES = ["num_reqs", "num_tokens"]


@triton.jit
def _token_span(qsl_ptr, req, num_reqs, num_tokens):
    """[start, end) of the tokens program ``req`` owns.

    Program ``num_reqs`` is the tail: the padding tokens past the last request.
    """
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1, mask=req < num_reqs, other=0)
    return start, tl.where(req == num_reqs, num_tokens, end)


@triton.jit
def _row_of(idx_mapping_ptr, req, num_reqs):
    """Table row of batch entry ``req``; -1 for padding requests and for the tail program."""
    return tl.load(idx_mapping_ptr + req, mask=req < num_reqs, other=-1).to(tl.int64)


@triton.jit(do_not_specialize=DYNAMIC_SIZES)
def _prepare_step_inputs_kernel(
    token_ids_ptr, token_ids_stride,  # [R, max_model_len] int32
    num_computed_ptr,  # [R]
    idx_mapping_ptr,  # [B]
    qsl_ptr,  # [B + 1]
    input_ids_ptr, positions_ptr,  # [T] int64 (out)
    seq_lens_ptr,  # [B] int32 (out)
    num_reqs, num_tokens, max_model_len,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    start, end = _token_span(qsl_ptr, req, num_reqs, num_tokens)
    row = _row_of(idx_mapping_ptr, req, num_reqs)
    has_row = row >= 0
    num_computed = tl.load(num_computed_ptr + row, mask=has_row, other=0).to(tl.int64)
    tl.store(seq_lens_ptr + req, tl.where(has_row, num_computed + end - start, 0).to(tl.int32),
             mask=req < num_reqs)
    # Scalar conditions enter vector masks as bounds: the interpreter mis-types scalar & vector.
    readable_len = tl.where(has_row, max_model_len, 0)
    for block_start in range(start, end, BLOCK):
        token = block_start + tl.arange(0, BLOCK)  # [BLOCK]
        in_req = token < end
        position = tl.where(has_row, num_computed + token - start, 0)
        readable = in_req & (position < readable_len)
        input_id = tl.load(token_ids_ptr + row * token_ids_stride + position, mask=readable, other=0)
        tl.store(input_ids_ptr + token, input_id.to(tl.int64), mask=in_req)
        tl.store(positions_ptr + token, position, mask=in_req)


@triton.jit(do_not_specialize=DYNAMIC_SIZES)
def _token_to_request_kernel(qsl_ptr, req_of_token_ptr, num_reqs, num_tokens, BLOCK: tl.constexpr):
    req = tl.program_id(0)
    start, end = _token_span(qsl_ptr, req, num_reqs, num_tokens)
    for block_start in range(start, end, BLOCK):
        token = block_start + tl.arange(0, BLOCK)
        tl.store(req_of_token_ptr + token, tl.full([BLOCK], req, tl.int64), mask=token < end)


@triton.jit(do_not_specialize=DYNAMIC_SIZES)
def _block_tables_kernel(
    block_table_ptr, block_table_stride, block_table_group_stride,  # [G, R, max_blocks] ([G, B, ...] when not HAS_IDX)
    idx_mapping_ptr,  # [B]
    qsl_ptr,  # [B + 1]
    positions_ptr,  # [T]
    out_tables_ptr, out_tables_stride, out_tables_group_stride,  # [G, B, max_blocks] (out, when GATHER)
    slot_mapping_ptr, slot_mapping_group_stride,  # [G, T] int64 (out, when SLOTS)
    num_reqs, num_tokens, max_blocks, block_size,
    HAS_IDX: tl.constexpr, GATHER: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_COLS: tl.constexpr, BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)  # one paged cache group per grid row
    block_table_ptr += group * block_table_group_stride
    out_tables_ptr += group * out_tables_group_stride
    slot_mapping_ptr += group * slot_mapping_group_stride
    if HAS_IDX:
        row = _row_of(idx_mapping_ptr, req, num_reqs)
    else:  # the table is already in batch order
        row = tl.where(req < num_reqs, req, -1).to(tl.int64)
    has_row = row >= 0
    # Scalar conditions enter vector masks as bounds: the interpreter mis-types scalar & vector.
    if GATHER:
        read_cols = tl.where(has_row, max_blocks, 0)
        write_cols = tl.where(req < num_reqs, max_blocks, 0)
        for col_start in range(0, max_blocks, BLOCK_COLS):
            col = col_start + tl.arange(0, BLOCK_COLS)
            block_id = tl.load(block_table_ptr + row * block_table_stride + col, mask=col < read_cols, other=0)
            tl.store(out_tables_ptr + req * out_tables_stride + col, block_id, mask=col < write_cols)
    if SLOTS:
        start, end = _token_span(qsl_ptr, req, num_reqs, num_tokens)
        owned_end = tl.where(has_row, end, start)  # a padding request owns no slots
        for block_start in range(start, end, BLOCK):
            token = block_start + tl.arange(0, BLOCK)
            in_req = token < end
            position = tl.load(positions_ptr + token, mask=token < owned_end, other=0).to(tl.int64)
            col = position // block_size
            readable = (token < owned_end) & (col < max_blocks)
            block_id = tl.load(block_table_ptr + row * block_table_stride + col, mask=readable, other=0)
            slot = tl.where(readable, block_id.to(tl.int64) * block_size + position % block_size, -1)
            tl.store(slot_mapping_ptr + token, slot, mask=in_req)


@triton.jit(do_not_specialize=["num_reqs", "width"])
def _post_update_kernel(
    token_ids_ptr, token_ids_stride,  # [R, max_model_len]
    num_tokens_ptr, num_computed_ptr,  # [R]
    counts_ptr, counts_stride,  # [R, V] (when HAS_COUNTS)
    idx_mapping_ptr, query_lens_ptr,  # [B]
    sampled_ptr, sampled_stride,  # [B, width]
    num_emitted_ptr, num_rejected_ptr,  # [B] (when SPEC)
    num_reqs, width, max_model_len,
    HAS_COUNTS: tl.constexpr, SPEC: tl.constexpr, BLOCK: tl.constexpr,
):
    req = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    row = tl.load(idx_mapping_ptr + req, mask=req < num_reqs, other=-1).to(tl.int64)
    has_row = row >= 0
    query_len = tl.load(query_lens_ptr + req, mask=has_row, other=0)
    computed = tl.load(num_computed_ptr + row, mask=has_row, other=0) + query_len
    known = tl.load(num_tokens_ptr + row, mask=has_row, other=0)
    is_new = has_row & (computed >= known)
    if SPEC:
        emitted = tl.load(num_emitted_ptr + req, mask=is_new, other=0).to(known.dtype)
        computed -= tl.load(num_rejected_ptr + req, mask=has_row, other=0).to(computed.dtype)
    else:
        emitted = is_new.to(known.dtype)
    tl.store(num_computed_ptr + row, computed.to(num_computed_ptr.dtype.element_ty), mask=has_row)
    for col in range(0, width):
        appended = col < emitted
        sampled = tl.load(sampled_ptr + req * sampled_stride + col, mask=appended, other=0).to(tl.int64)
        position = known + col
        # A token sampled at max_model_len is returned but never fed back, so it is not stored.
        tl.store(token_ids_ptr + row * token_ids_stride + position,
                 sampled.to(token_ids_ptr.dtype.element_ty), mask=appended & (position < max_model_len))
        if HAS_COUNTS:
            count_ptr = counts_ptr + row * counts_stride + sampled
            count = tl.load(count_ptr, mask=appended, other=0)
            tl.store(count_ptr, count + 1, mask=appended)
    tl.store(num_tokens_ptr + row, known + emitted, mask=has_row)


@triton.jit(do_not_specialize=["num_writes"])
def _scatter_flat_kernel(target_ptr, flat_index_ptr, values_ptr, num_writes, BLOCK: tl.constexpr):
    write = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = write < num_writes
    flat_index = tl.load(flat_index_ptr + write, mask=in_range, other=0)
    value = tl.load(values_ptr + write, mask=in_range)
    tl.store(target_ptr + flat_index, value.to(target_ptr.dtype.element_ty), mask=in_range)


def token_to_request_triton(query_start_loc: torch.Tensor, num_tokens: int,
                            num_reqs: int | None = None) -> torch.Tensor:
    num_reqs = query_start_loc.shape[0] - 1 if num_reqs is None else num_reqs
    req_of_token = torch.empty(num_tokens, dtype=torch.int64, device=query_start_loc.device)  # [T]
    _token_to_request_kernel[(num_reqs + 1,)](query_start_loc, req_of_token, num_reqs, num_tokens,
                                              BLOCK=TOKEN_BLOCK)
    return req_of_token


def prepare_step_inputs_triton(token_ids, num_computed_tokens, idx_mapping, query_start_loc, num_tokens,
                               out=None):
    num_reqs = idx_mapping.shape[0]
    device = token_ids.device
    if out is None:
        out = (torch.empty(num_tokens, dtype=torch.int64, device=device),  # input_ids [T]
               torch.empty(num_tokens, dtype=torch.int64, device=device),  # positions [T]
               torch.empty(num_reqs, dtype=torch.int32, device=device))  # seq_lens [B]
    input_ids, positions, seq_lens = out
    _prepare_step_inputs_kernel[(num_reqs + 1,)](
        token_ids, token_ids.stride(0), num_computed_tokens, idx_mapping, query_start_loc,
        input_ids, positions, seq_lens, num_reqs, num_tokens, token_ids.shape[1], BLOCK=TOKEN_BLOCK)
    return input_ids, positions, seq_lens


def _launch_block_tables(block_table, idx_mapping, query_start_loc, positions, block_size, num_reqs,
                         gather: bool, slots: bool, out=None):
    """``block_table`` [G, R, max_blocks] (or [G, B, max_blocks] without ``idx_mapping``)."""
    num_groups, _, max_blocks = block_table.shape
    num_tokens = positions.shape[0] if slots else 0
    device = block_table.device
    if out is None:
        out = (torch.empty((num_groups, num_reqs, max_blocks), dtype=block_table.dtype, device=device)
               if gather else block_table,  # [G, B, max_blocks]
               torch.empty((num_groups, num_tokens), dtype=torch.int64, device=device)
               if slots else block_table)  # [G, T]
    out_tables, slot_mapping = out
    # Without slots there is no tail of padding tokens to cover, so no tail program.
    grid = (num_reqs + 1 if slots else num_reqs, num_groups)
    _block_tables_kernel[grid](
        block_table, block_table.stride(1), block_table.stride(0),
        idx_mapping if idx_mapping is not None else block_table,
        query_start_loc if slots else block_table, positions if slots else block_table,
        out_tables, out_tables.stride(1), out_tables.stride(0), slot_mapping, slot_mapping.stride(0),
        num_reqs, num_tokens, max_blocks, block_size,
        HAS_IDX=idx_mapping is not None, GATHER=gather, SLOTS=slots,
        BLOCK_COLS=min(max(triton.next_power_of_2(max_blocks), 16), 1024), BLOCK=TOKEN_BLOCK)
    return out_tables, slot_mapping


def gather_block_tables_triton(block_table, idx_mapping):
    out_tables, _ = _launch_block_tables(block_table.unsqueeze(0), idx_mapping, None, None, 1,
                                         idx_mapping.shape[0], gather=True, slots=False)
    return out_tables[0]


def compute_slot_mapping_triton(block_tables, query_start_loc, positions, block_size):
    _, slot_mapping = _launch_block_tables(block_tables.unsqueeze(0), None, query_start_loc, positions, block_size,
                                           block_tables.shape[0], gather=False, slots=True)
    return slot_mapping[0]


def gather_block_tables_and_slot_mapping_triton(block_tables, idx_mapping, query_start_loc, positions,
                                                block_size, out=None):
    return _launch_block_tables(block_tables, idx_mapping, query_start_loc, positions, block_size,
                                idx_mapping.shape[0], gather=True, slots=True, out=out)


def post_update_triton(token_ids, num_tokens, num_computed_tokens, output_token_counts, idx_mapping,
                       query_lens, sampled_token_ids, num_emitted=None, num_rejected=None) -> None:
    num_reqs = idx_mapping.shape[0]
    has_counts = output_token_counts is not None
    counts = output_token_counts if has_counts else num_tokens
    spec = num_emitted is not None
    sampled = sampled_token_ids.view(num_reqs, -1)  # [B, width]
    _post_update_kernel[(triton.cdiv(num_reqs, REQ_BLOCK),)](
        token_ids, token_ids.stride(0), num_tokens, num_computed_tokens,
        counts, counts.stride(0), idx_mapping, query_lens, sampled, sampled.stride(0),
        num_emitted if spec else query_lens, num_rejected if spec else query_lens,
        num_reqs, sampled.shape[1], token_ids.shape[1], HAS_COUNTS=has_counts, SPEC=spec, BLOCK=REQ_BLOCK)


def scatter_flat_triton(target: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> None:
    if not target.is_contiguous():
        raise ValueError(f"scatter_flat needs a contiguous target, got strides {target.stride()}")
    num_writes = flat_index.shape[0]
    if num_writes == 0:
        return
    _scatter_flat_kernel[(triton.cdiv(num_writes, SCATTER_BLOCK),)](
        target, flat_index, values, num_writes, BLOCK=SCATTER_BLOCK)
