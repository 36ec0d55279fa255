"""Gathers the batch's sampling metadata from the request table, on the device."""

from __future__ import annotations

import numpy as np
import torch

from weir.buffers.staged_write import host_to_device
from weir.runner.request_table import RequestTable
from weir.sample.metadata import SamplingMetadata


def gather_sampling_metadata(
    table: RequestTable,
    rows: np.ndarray,  # [B] table rows in batch order (host)
    idx_mapping: torch.Tensor,  # [B] the same rows on the device
    sample_positions: torch.Tensor,  # [B] position of the token each row samples
    req_ids: list[str],
    min_tokens_req_ids: set[str],
) -> SamplingMetadata:
    temperature = table.temperature_host[rows]
    greedy = temperature == 0
    uses_penalties = bool(table.uses_penalties_host[rows].any())

    banned = None
    banned_rows, banned_tokens = [], []
    for batch_idx, req_id in enumerate(req_ids):
        if req_id in min_tokens_req_ids:
            stop_ids = table.stop_token_ids[rows[batch_idx]]
            banned_rows += [batch_idx] * len(stop_ids)
            banned_tokens += stop_ids
    if banned_rows:
        device, pin = table.device, table.pin_memory
        banned = (host_to_device(np.array(banned_rows, dtype=np.int64), device, pin),
                  host_to_device(np.array(banned_tokens, dtype=np.int64), device, pin))

    num_logprobs = table.num_logprobs_host[rows].max()
    return SamplingMetadata(
        temperature=table.temperature.gpu[idx_mapping],
        top_k=table.top_k.gpu[idx_mapping],
        top_p=table.top_p.gpu[idx_mapping],
        min_p=table.min_p.gpu[idx_mapping],
        seeds=table.seeds.gpu[idx_mapping],
        positions=sample_positions.long(),
        presence_penalty=table.presence_penalty.gpu[idx_mapping],
        frequency_penalty=table.frequency_penalty.gpu[idx_mapping],
        repetition_penalty=table.repetition_penalty.gpu[idx_mapping],
        output_token_counts=table.output_token_counts[idx_mapping] if uses_penalties else None,
        prompt_token_mask=table.prompt_token_mask[idx_mapping] if uses_penalties else None,
        banned_token_ids=banned,
        max_num_logprobs=None if num_logprobs < 0 else int(num_logprobs),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        no_top_k=bool((table.top_k_host[rows][~greedy] == 0).all()),
        no_top_p=bool((table.top_p_host[rows][~greedy] == 1).all()),
        no_min_p=bool((table.min_p_host[rows][~greedy] == 0).all()),
        no_penalties=not uses_penalties,
    )
