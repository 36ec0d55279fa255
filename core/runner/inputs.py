"""Building one step's inputs on the device from the request table.

Each op runs its Triton kernel (``weir.kernels.triton_input_prep``) on CUDA tensors and its
``*_torch`` version elsewhere (``weir.kernels.dispatch``: ``WEIR_DISABLE_TRITON=1`` forces
torch). The torch versions are the oracles the kernels are tested against. None of these ops
reads a device value on the host: every size they need is a host integer the scheduler
already knows (``num_tokens``, and tensor shapes).

Padding (a batch padded to a CUDA-graph size) follows one convention in both versions: a
padding request either points at the request table's spare all-zero row (what the runner's
CUDA-graph batches do: it reads token 0 and writes only the null block) or has
``idx_mapping[r] == -1`` (it reads and writes no table row, and gets
``seq_lens == 0``, a zero block-table row and slot -1), and tokens past
``query_start_loc[num_reqs]`` belong to no request (``input_ids`` and ``positions`` 0, slot -1).
See ``weir.kernels.triton_input_prep`` for the details.
"""

from __future__ import annotations

import torch

from weir.kernels.dispatch import triton_module, use_triton


def _kernels():
    return triton_module("triton_input_prep")


def token_to_request(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Batch index of each token: token t belongs to request r when qsl[r] <= t < qsl[r+1].

    Tokens past the last request get ``num_reqs`` (``query_start_loc.shape[0] - 1``).
    """
    if use_triton(query_start_loc):
        return _kernels().token_to_request_triton(query_start_loc, num_tokens)
    return token_to_request_torch(query_start_loc, num_tokens)


def token_to_request_torch(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    qsl = query_start_loc.long()
    token_idx = torch.arange(num_tokens, device=qsl.device)
    return torch.searchsorted(qsl[1:], token_idx, right=True)  # [T]


def prepare_step_inputs(
    token_ids: torch.Tensor,  # [R, max_model_len] int32
    num_computed_tokens: torch.Tensor,  # [R] int32
    idx_mapping: torch.Tensor,  # [B] int64: batch position -> table row, -1 = padding
    query_start_loc: torch.Tensor,  # [B + 1] int32
    num_tokens: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns input_ids [T] int64, positions [T] int64, seq_lens [B] int32 (written into ``out``
    when given: the runner's persistent buffers, which its CUDA graphs read)."""
    if use_triton(token_ids):
        return _kernels().prepare_step_inputs_triton(
            token_ids, num_computed_tokens, idx_mapping, query_start_loc, num_tokens, out)
    results = prepare_step_inputs_torch(token_ids, num_computed_tokens, idx_mapping, query_start_loc, num_tokens)
    return _into(out, results)


def _into(out, results):
    if out is None:
        return results
    for buffer, result in zip(out, results):
        buffer.copy_(result)
    return out


def _token_owners(query_start_loc: torch.Tensor, num_reqs: int, num_tokens: int):
    """(request of each token clamped into the batch, token index, whether a request owns it)."""
    qsl = query_start_loc[: num_reqs + 1].long()
    token_idx = torch.arange(num_tokens, device=qsl.device)  # [T]
    req_of_token = torch.searchsorted(qsl[1:], token_idx, right=True)  # [T]; num_reqs past the end
    return req_of_token.clamp_max(num_reqs - 1), token_idx, req_of_token < num_reqs


def prepare_step_inputs_torch(token_ids, num_computed_tokens, idx_mapping, query_start_loc, num_tokens):
    num_reqs = idx_mapping.shape[0]
    qsl = query_start_loc[: num_reqs + 1].long()
    req_of_token, token_idx, owned = _token_owners(qsl, num_reqs, num_tokens)  # [T]
    has_row = idx_mapping >= 0  # [B]
    row_of_req = idx_mapping.clamp_min(0)  # [B]
    row_of_token = row_of_req[req_of_token]  # [T]
    token_valid = owned & has_row[req_of_token]  # [T]
    offset_in_req = token_idx - qsl[req_of_token]
    positions = torch.where(token_valid, num_computed_tokens[row_of_token].long() + offset_in_req, 0)  # [T]
    # Positions past max_model_len (a proposer's pass after a request's last slot) read nothing,
    # as in the Triton kernel.
    last = token_ids.shape[1] - 1
    readable = token_valid & (positions <= last)  # [T]
    input_ids = torch.where(readable, token_ids[row_of_token, positions.clamp_max(last)].long(), 0)  # [T]
    query_lens = qsl[1:] - qsl[:-1]  # [B]
    seq_lens = torch.where(has_row, num_computed_tokens[row_of_req].long() + query_lens, 0).int()  # [B]
    return input_ids, positions, seq_lens


def gather_block_tables(block_table: torch.Tensor, idx_mapping: torch.Tensor) -> torch.Tensor:
    """Rows of the persistent block table in batch order [B, max_blocks]; padding rows are 0."""
    if use_triton(block_table):
        return _kernels().gather_block_tables_triton(block_table, idx_mapping)
    return gather_block_tables_torch(block_table, idx_mapping)


def gather_block_tables_torch(block_table: torch.Tensor, idx_mapping: torch.Tensor) -> torch.Tensor:
    rows = block_table[idx_mapping.clamp_min(0)]  # [B, max_blocks_per_req]
    return torch.where((idx_mapping >= 0).unsqueeze(1), rows, 0)


def compute_slot_mapping(
    block_tables: torch.Tensor,  # [B, max_blocks_per_req] (already gathered)
    query_start_loc: torch.Tensor,  # [B + 1]
    positions: torch.Tensor,  # [T]
    block_size: int,
) -> torch.Tensor:
    """KV slot of every token: block_tables[req, pos // block_size] * block_size + pos % block_size.

    Tokens past the last request get -1. A padding request's tokens land in its zero row, that
    is in the reserved null block; ``gather_block_tables_and_slot_mapping`` gives them -1.
    """
    if use_triton(block_tables):
        return _kernels().compute_slot_mapping_triton(block_tables, query_start_loc, positions, block_size)
    return compute_slot_mapping_torch(block_tables, query_start_loc, positions, block_size)


def compute_slot_mapping_torch(block_tables, query_start_loc, positions, block_size, has_row=None):
    """``has_row`` [B] (optional): requests whose tokens get a slot; the others get -1."""
    num_reqs = block_tables.shape[0]
    req_of_token, _, token_valid = _token_owners(query_start_loc, num_reqs, positions.shape[0])
    if has_row is not None:
        token_valid = token_valid & has_row[req_of_token]
    # A position past the table's last block (a draft pass beyond max_model_len) gets -1, as in
    # the Triton kernel: it has no block to write.
    token_valid = token_valid & (positions.long() // block_size < block_tables.shape[1])  # [T]
    positions = torch.where(token_valid, positions.long(), 0)  # [T]
    block_ids = block_tables[req_of_token, positions // block_size].long()  # [T]
    return torch.where(token_valid, block_ids * block_size + positions % block_size, -1)  # [T] int64


def gather_block_tables_and_slot_mapping(
    block_tables: torch.Tensor,  # [G, R, max_blocks_per_req]: every paged cache group's persistent table
    idx_mapping: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    positions: torch.Tensor,  # [T]
    block_size: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's tables in one launch: block_tables [G, B, max_blocks] and slot_mapping
    [G, T] int64 (written into ``out`` when given)."""
    if use_triton(block_tables):
        return _kernels().gather_block_tables_and_slot_mapping_triton(
            block_tables, idx_mapping, query_start_loc, positions, block_size, out)
    results = gather_block_tables_and_slot_mapping_torch(block_tables, idx_mapping, query_start_loc, positions,
                                                         block_size)
    return _into(out, results)


def gather_block_tables_and_slot_mapping_torch(block_tables, idx_mapping, query_start_loc, positions, block_size):
    gathered = [gather_block_tables_torch(table, idx_mapping) for table in block_tables]
    slot_mappings = [compute_slot_mapping_torch(table, query_start_loc, positions, block_size,
                                                has_row=idx_mapping >= 0) for table in gathered]
    return torch.stack(gathered), torch.stack(slot_mappings)


def post_update(
    token_ids: torch.Tensor,  # [R, max_model_len]
    num_tokens: torch.Tensor,  # [R]
    num_computed_tokens: torch.Tensor,  # [R]
    output_token_counts: torch.Tensor | None,  # [R, V]
    idx_mapping: torch.Tensor,  # [B]; -1 = padding, left untouched
    query_lens: torch.Tensor,  # [B]
    sampled_token_ids: torch.Tensor,  # [B] int64, or [B, S] with speculative decoding
    num_emitted: torch.Tensor | None = None,  # [B]: tokens of each row of sampled_token_ids to append
    num_rejected: torch.Tensor | None = None,  # [B]: drafts the step computed and rejected
) -> None:
    """After sampling: advance progress, and append the sampled tokens where they are real.

    A sample is real when the row's chunk reached its last known token; for a partial
    prefill chunk it is dropped here and on the host alike. With speculative decoding a row
    appends its first ``num_emitted`` tokens (accepted drafts, then the sampled one) and its
    computed tokens advance by the query length less its rejected drafts, whose KV slots later
    steps overwrite. Real rows must be distinct.
    """
    if (num_emitted is None) != (num_rejected is None) or (num_emitted is None) != (sampled_token_ids.dim() == 1):
        raise ValueError("post_update takes [B] samples alone, or [B, S] samples with num_emitted and num_rejected")
    if use_triton(token_ids):
        _kernels().post_update_triton(token_ids, num_tokens, num_computed_tokens, output_token_counts,
                                      idx_mapping, query_lens, sampled_token_ids, num_emitted, num_rejected)
    else:
        post_update_torch(token_ids, num_tokens, num_computed_tokens, output_token_counts, idx_mapping,
                          query_lens, sampled_token_ids, num_emitted, num_rejected)


def post_update_torch(token_ids, num_tokens, num_computed_tokens, output_token_counts, idx_mapping,
                      query_lens, sampled_token_ids, num_emitted=None, num_rejected=None) -> None:
    # Padding entries alias row 0 after the clamp; every write below adds a delta (zero for
    # padding) instead of assigning, so an alias never clobbers a real row's update.
    has_row = idx_mapping >= 0  # [B]
    rows = idx_mapping.clamp_min(0)  # [B]
    count_dtype = num_computed_tokens.dtype
    query_lens = torch.where(has_row, query_lens.to(count_dtype), 0)  # [B]
    computed = num_computed_tokens[rows] + query_lens  # [B]
    known = num_tokens[rows]  # [B]
    is_new_token = has_row & (computed >= known)
    sampled = sampled_token_ids.view(rows.shape[0], -1)  # [B, S]
    width = sampled.shape[1]
    emitted = torch.ones_like(known) if num_emitted is None else num_emitted.to(known.dtype)
    emitted = torch.where(is_new_token, emitted, 0)  # [B]
    rejected = 0 if num_rejected is None else torch.where(has_row, num_rejected.to(count_dtype), 0)
    max_len = token_ids.shape[1]
    cols = torch.arange(width, device=rows.device)  # [S]
    appended = cols.unsqueeze(0) < emitted.unsqueeze(1)  # [B, S]
    position = known.long().unsqueeze(1) + cols  # [B, S]
    # A token sampled at max_model_len is returned but never fed back, so it is not stored.
    writable = appended & (position < max_len)
    flat_pos = rows.unsqueeze(1) * max_len + position.clamp_max(max_len - 1)  # [B, S]
    flat_tokens = token_ids.view(-1)
    values = torch.where(appended, sampled, 0)  # [B, S]
    token_delta = torch.where(writable, values.to(token_ids.dtype) - flat_tokens[flat_pos], 0)
    flat_tokens.index_add_(0, flat_pos.reshape(-1), token_delta.reshape(-1))
    num_computed_tokens.index_add_(0, rows, query_lens - rejected)
    num_tokens.index_add_(0, rows, emitted.to(num_tokens.dtype))
    if output_token_counts is not None:
        output_token_counts.index_put_((rows.unsqueeze(1).expand(-1, width), values),
                                       appended.to(output_token_counts.dtype), accumulate=True)
