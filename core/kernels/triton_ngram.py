"""n-gram (prompt lookup) drafts in one Triton launch per step.

``weir.spec_decode.ngram.propose_ngram`` followed by ``write_drafts`` is the oracle: the same
match rule (the longest suffix first; of its occurrences the latest one followed by
``num_drafts`` known tokens, else the earliest), the same drafts written after each row's known
tokens inside ``max_model_len``, and the same counts. The torch version launches well over a
hundred small ops a step; here one program handles one sampled row. The grid and every loop
bound come from host integers, so nothing synchronises.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WINDOW_BLOCK = 1024  # window starts one program compares per loop step


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit(do_not_specialize=["max_len", "n_high", "min_n"])
def _ngram_kernel(
    token_ids_ptr, token_ids_stride,  # [R, max_model_len] int32: read as history, drafts written after it
    num_tokens_ptr,  # [R] known tokens per row
    num_drafts_ptr,  # [R] drafts per row, written for the rows proposed for
    rows_ptr,  # [M] int64: rows that sampled this step
    max_len,  # host bound on num_tokens[rows], at most max_model_len
    max_model_len,
    n_high,  # the longest n-gram tried: min(max_n, max_len - 1)
    min_n,
    NUM_DRAFTS: tl.constexpr, DRAFT_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    history = token_ids_ptr + row * token_ids_stride
    known = tl.load(num_tokens_ptr + row).to(tl.int64)
    length = tl.minimum(known, max_len)
    best_end = known * 0 - 1  # index after the chosen match; -1: none yet
    for step in range(0, n_high - min_n + 1):
        n = n_high - step
        if best_end < 0:
            latest_full = known * 0 - 1  # -1: no match followed by NUM_DRAFTS known tokens
            earliest = known * 0 + max_len  # max_len: no match
            for block_start in range(0, max_len - n + 1, BLOCK):
                starts = block_start + tl.arange(0, BLOCK)  # [BLOCK] window starts
                in_range = starts <= max_len - n
                matches = in_range
                for offset in range(0, n):
                    suffix_token = tl.load(history + tl.maximum(length - n + offset, 0))
                    window_token = tl.load(history + starts + offset, mask=in_range, other=0)
                    matches = matches & (window_token == suffix_token)
                # An earlier occurrence with at least one known token after it (not the suffix itself).
                matches = matches & (starts + n < length) & (length > n)
                full = matches & (starts + n + NUM_DRAFTS <= length)
                latest_full = tl.maximum(latest_full, tl.reduce(tl.where(full, starts, -1), 0, _max_combine))
                earliest = tl.minimum(earliest, tl.reduce(tl.where(matches, starts, max_len), 0, _min_combine))
            start = tl.where(latest_full >= 0, latest_full, earliest)
            best_end = tl.where(start < max_len, start + n, best_end)
    offsets = tl.arange(0, DRAFT_BLOCK)  # [DRAFT_BLOCK]
    in_drafts = offsets < NUM_DRAFTS
    draft_at = best_end + offsets
    # best_end >= 0, compared per element: Triton's interpreter rejects a block mask combined
    # with a scalar comparison of a value set inside the loop's branch.
    available = in_drafts & (draft_at >= offsets) & (draft_at < length)
    drafts = tl.load(history + tl.minimum(tl.maximum(draft_at, 0), max_len - 1), mask=available, other=0)
    columns = known + offsets  # drafts go right after the known tokens, zeros past the found ones
    tl.store(history + columns, drafts, mask=in_drafts & (columns < max_model_len))
    count = tl.reduce(available.to(tl.int64), 0, _add_combine)
    count = tl.minimum(count, tl.maximum(max_model_len - known, 0))
    tl.store(num_drafts_ptr + row, count.to(num_drafts_ptr.dtype.element_ty))


def propose_ngram_triton(
    token_ids: torch.Tensor,  # [R, max_model_len] int32
    num_tokens: torch.Tensor,  # [R]
    num_drafts: torch.Tensor,  # [R]: written for ``rows``
    rows: torch.Tensor,  # [M] int64
    max_len: int,
    min_n: int,
    max_n: int,
    num_speculative_tokens: int,
) -> None:
    """Each row's drafts into ``token_ids[row, num_tokens[row]:]`` and their count into
    ``num_drafts[row]``, as ``propose_ngram`` + ``write_drafts`` write them."""
    if rows.shape[0] == 0:
        return
    if not token_ids.is_contiguous() or token_ids.dtype != torch.int32:
        raise ValueError(f"propose_ngram_triton needs a contiguous int32 token table, got {token_ids.dtype} "
                         f"with strides {token_ids.stride()}")
    max_model_len = token_ids.shape[1]
    max_len = max(1, min(max_len, max_model_len))
    _ngram_kernel[(rows.shape[0],)](
        token_ids, token_ids.stride(0), num_tokens, num_drafts, rows, max_len, max_model_len,
        min(max_n, max_len - 1), min_n, NUM_DRAFTS=num_speculative_tokens,
        DRAFT_BLOCK=triton.next_power_of_2(num_speculative_tokens), BLOCK=WINDOW_BLOCK)
