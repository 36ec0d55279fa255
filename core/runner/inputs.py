"""Building one step's inputs on the device from the request table, in torch ops.

These functions are the seams the GPU issue replaces with Triton kernels of the same
signatures. None of them reads a device value on the host: every size they need is a host
integer the scheduler already knows.
"""

from __future__ import annotations

import torch


def token_to_request(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Batch index of each token: token t belongs to request r when qsl[r] <= t < qsl[r+1]."""
    token_idx = torch.arange(num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:], token_idx, right=True)  # [T]


def prepare_step_inputs(
    token_ids: torch.Tensor,  # [R, max_model_len] int32
    num_computed_tokens: torch.Tensor,  # [R] int32
    idx_mapping: torch.Tensor,  # [B] int64: batch position -> table row
    query_start_loc: torch.Tensor,  # [B + 1] int32
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns input_ids [T] int64, positions [T] int64, seq_lens [B] int32."""
    qsl = query_start_loc.long()
    req_of_token = token_to_request(qsl, num_tokens)  # [T]
    row_of_token = idx_mapping[req_of_token]  # [T]
    offset_in_req = torch.arange(num_tokens, device=qsl.device) - qsl[req_of_token]
    positions = num_computed_tokens[row_of_token].long() + offset_in_req  # [T]
    input_ids = token_ids[row_of_token, positions].long()  # [T]
    query_lens = qsl[1:] - qsl[:-1]  # [B]
    seq_lens = (num_computed_tokens[idx_mapping].long() + query_lens).int()  # [B]
    return input_ids, positions, seq_lens


def gather_block_tables(block_table: torch.Tensor, idx_mapping: torch.Tensor) -> torch.Tensor:
    return block_table[idx_mapping]  # [B, max_blocks_per_req]


def compute_slot_mapping(
    block_tables: torch.Tensor,  # [B, max_blocks_per_req] (already gathered)
    query_start_loc: torch.Tensor,  # [B + 1]
    positions: torch.Tensor,  # [T]
    block_size: int,
) -> torch.Tensor:
    """KV slot of every token: block_tables[req, pos // block_size] * block_size + pos % block_size."""
    req_of_token = token_to_request(query_start_loc.long(), positions.shape[0])
    block_ids = block_tables[req_of_token, positions // block_size].long()  # [T]
    return block_ids * block_size + positions % block_size  # [T] int64


def post_update(
    token_ids: torch.Tensor,  # [R, max_model_len]
    num_tokens: torch.Tensor,  # [R]
    num_computed_tokens: torch.Tensor,  # [R]
    output_token_counts: torch.Tensor | None,  # [R, V]
    idx_mapping: torch.Tensor,  # [B]
    query_lens: torch.Tensor,  # [B]
    sampled_token_ids: torch.Tensor,  # [B] int64
) -> None:
    """After sampling: advance progress, and append the sampled token where it is real.

    A sample is real when the row's chunk reached its last known token; for a partial
    prefill chunk it is dropped here and on the host alike.
    """
    computed = num_computed_tokens[idx_mapping] + query_lens.to(num_computed_tokens.dtype)  # [B]
    num_computed_tokens[idx_mapping] = computed
    known = num_tokens[idx_mapping]  # [B]
    is_new_token = computed >= known
    max_len = token_ids.shape[1]
    write_pos = known.long().clamp_max(max_len - 1)
    # A token sampled at max_model_len is returned but never fed back, so it is not stored.
    writable = is_new_token & (known < max_len)
    previous = token_ids[idx_mapping, write_pos]
    token_ids[idx_mapping, write_pos] = torch.where(writable, sampled_token_ids.to(token_ids.dtype), previous)
    num_tokens[idx_mapping] = known + is_new_token.to(known.dtype)
    if output_token_counts is not None:
        output_token_counts[idx_mapping, sampled_token_ids] += is_new_token.to(output_token_counts.dtype)
