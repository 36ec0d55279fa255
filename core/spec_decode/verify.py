"""Verification of one step's drafts: its logits rows, the target's processed distributions at
every one of them, rejection sampling and the emitted tokens' logprobs.

Layout: request ``b`` with ``k_b`` drafts owns ``k_b + 1`` consecutive logits rows (its last
``k_b + 1`` tokens: the token before its drafts, then each draft); a request without drafts
owns one (its last token). ``flat_of[b, j]`` is the logits row of (request, j), clamped to the
request's last row, so per-request tensors are ``[B, S]`` with ``S = max k_b + 1``.

Each row is sampled as the sampler samples a lone token there: bans, penalties, temperature,
min-p, top-k/top-p, noise keyed on (seed, position). Two things depend on the drafts before the
row: penalties count them among the output tokens, and ``min_tokens`` bans the stop tokens of
rows whose output index (known on the device only, under async scheduling) is below it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weir.buffers import host_to_device, int64_arrays_to_device
from weir.sample import Sampler, ops
from weir.spec_decode.rejection import rejection_sample


@dataclass
class VerifyLayout:
    """Host arrays of one step's logits rows, and their device copies."""

    num_drafts: np.ndarray  # [B] drafts scheduled per request
    logits_indices: np.ndarray  # [N] token index of each logits row
    req_of_row: np.ndarray  # [N]
    j_of_row: np.ndarray  # [N]
    flat_of: np.ndarray  # [B, S]
    device: dict[str, torch.Tensor]

    @property
    def num_rows(self) -> int:
        return len(self.logits_indices)

    @property
    def width(self) -> int:
        return self.flat_of.shape[1]


def verify_layout(query_start_loc: np.ndarray, num_drafts: np.ndarray, device: torch.device,
                  pin_memory: bool) -> VerifyLayout:
    """``query_start_loc`` [B + 1] of the real requests; ``num_drafts`` [B]."""
    num_drafts = np.asarray(num_drafts, dtype=np.int64)
    rows_per_req = num_drafts + 1
    first_row = np.zeros(len(num_drafts) + 1, dtype=np.int64)
    np.cumsum(rows_per_req, out=first_row[1:])
    req_of_row = np.repeat(np.arange(len(num_drafts), dtype=np.int64), rows_per_req)
    j_of_row = np.arange(first_row[-1], dtype=np.int64) - first_row[req_of_row]
    ends = np.asarray(query_start_loc[1: len(num_drafts) + 1], dtype=np.int64)
    logits_indices = ends[req_of_row] - rows_per_req[req_of_row] + j_of_row
    width = int(num_drafts.max(initial=0)) + 1
    cols = np.arange(width, dtype=np.int64)
    flat_of = first_row[:-1, None] + np.minimum(cols[None, :], num_drafts[:, None])
    arrays = {"num_drafts": num_drafts, "logits_indices": logits_indices, "req_of_row": req_of_row,
              "j_of_row": j_of_row, "flat_of": flat_of}
    on_device = dict(zip(arrays, int64_arrays_to_device(list(arrays.values()), device, pin_memory)))
    return VerifyLayout(num_drafts, logits_indices, req_of_row, j_of_row, flat_of, on_device)


@dataclass
class SpecSamplerOutput:
    """One step's emitted tokens per request, on the device."""

    token_ids: torch.Tensor  # [B, S] int64, -1 past each request's emitted tokens
    num_emitted: torch.Tensor  # [B] int64: accepted drafts + 1
    num_rejected: torch.Tensor  # [B] int64: scheduled drafts - accepted
    num_verified: torch.Tensor  # [B] int64: drafts that existed (an n-gram may find fewer)
    logprob_token_ids: torch.Tensor | None  # [B, S, 1 + k]
    logprobs: torch.Tensor | None  # [B, S, 1 + k] fp32
    ranks: torch.Tensor | None  # [B, S]


class Verifier:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def verify(
        self,
        logits: torch.Tensor,  # [N, V]: the target's logits at every logits row
        layout: VerifyLayout,
        idx_mapping: torch.Tensor,  # [B] table (= sampler) row of each request, device
        rows: np.ndarray,  # [B] the same, host
        input_ids: torch.Tensor,  # [T] the step's input tokens (drafts included)
        positions: torch.Tensor,  # [T]
        num_tokens: torch.Tensor,  # [R] known tokens per table row, before this step's update
        num_prompt_tokens: torch.Tensor,  # [R]
        num_drafts_ready: torch.Tensor,  # [R] drafts the proposer wrote per row
    ) -> SpecSamplerOutput:
        dev = layout.device
        row_of_logit = idx_mapping[dev["req_of_row"]]  # [N]
        rows_host = np.asarray(rows, dtype=np.int64)[layout.req_of_row]
        token_index = dev["logits_indices"]
        noise_positions = positions[token_index].long() + 1  # tokens before the one each row samples
        metadata = self.sampler.batch_metadata(row_of_logit, rows_host, noise_positions).gathered()
        num_tokens_in = input_ids.shape[0]
        draft_tokens = input_ids[(token_index + 1).clamp_max(num_tokens_in - 1)].long()  # [N]

        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.float().log_softmax(dim=-1)
        constrained = logits.float()
        constrained = self._ban_below_min_tokens(constrained, layout, rows, row_of_logit, num_tokens,
                                                 num_prompt_tokens)
        if not metadata.no_penalties:
            counts = self._counts_with_drafts(metadata.output_token_counts, layout, draft_tokens)
            constrained = ops.apply_penalties(constrained, metadata.prompt_token_mask, counts,
                                              metadata.repetition_penalty, metadata.frequency_penalty,
                                              metadata.presence_penalty)
        greedy_tokens = constrained.argmax(dim=-1)  # [N]
        processed = None
        if not metadata.all_greedy:
            processed = ops.apply_temperature(constrained, metadata.temperature)
            if not metadata.no_min_p:
                processed = ops.apply_min_p(processed, metadata.min_p)
            processed = ops.apply_top_k_top_p(processed, None if metadata.no_top_k else metadata.top_k,
                                              None if metadata.no_top_p else metadata.top_p)
        is_greedy = (metadata.temperature == 0) | (metadata.top_k == 1)
        num_valid = torch.minimum(dev["num_drafts"], num_drafts_ready[idx_mapping].long())  # [B]
        result = rejection_sample(processed, greedy_tokens, is_greedy, draft_tokens, None, metadata.seeds,
                                  metadata.positions, dev["flat_of"], num_valid)
        num_emitted = result.num_accepted + 1
        logprob_ids = logprobs = ranks = None
        if raw_logprobs is not None:
            gathered = Sampler.gather_logprobs(raw_logprobs, result.emitted_per_row, metadata.max_num_logprobs)
            flat_of = dev["flat_of"]
            logprob_ids = gathered.logprob_token_ids[flat_of]  # [B, S, 1 + k]
            logprobs = gathered.logprobs[flat_of]
            ranks = gathered.sampled_token_ranks[flat_of]
        return SpecSamplerOutput(result.emitted, num_emitted, dev["num_drafts"] - result.num_accepted,
                                 result.num_verified, logprob_ids, logprobs, ranks)

    def _counts_with_drafts(self, counts: torch.Tensor, layout: VerifyLayout,
                            draft_tokens: torch.Tensor) -> torch.Tensor:
        """Output-token counts of each logits row: its request's, plus the drafts before it."""
        dev = layout.device
        vocab_size = counts.shape[-1]
        is_draft_row = dev["j_of_row"] < dev["num_drafts"][dev["req_of_row"]]  # rows that verify a draft
        one_hot = torch.zeros_like(counts)
        one_hot.scatter_(1, draft_tokens.clamp(0, vocab_size - 1).unsqueeze(1),
                         is_draft_row.to(counts.dtype).unsqueeze(1))
        before = one_hot.cumsum(dim=0) - one_hot  # [N, V]: drafts of every earlier row
        first_row = dev["flat_of"][:, 0][dev["req_of_row"]]  # [N]
        return counts + before - before[first_row]

    def _ban_below_min_tokens(self, logits: torch.Tensor, layout: VerifyLayout, rows: np.ndarray,
                              row_of_logit: torch.Tensor, num_tokens: torch.Tensor,
                              num_prompt_tokens: torch.Tensor) -> torch.Tensor:
        """-inf for stop tokens at rows whose output index is below their request's min_tokens."""
        states = self.sampler.states
        rows = np.asarray(rows, dtype=np.int64)
        pair_rows, pair_tokens, pair_limits = [], [], []
        for b in np.flatnonzero(states.min_tokens_host[rows] > 0):  # usually none
            row = rows[b]
            stop_ids = states.stop_token_ids[row]
            if stop_ids.size == 0:
                continue
            logit_rows = np.flatnonzero(layout.req_of_row == b)
            pair_rows.append(np.repeat(logit_rows, stop_ids.size))
            pair_tokens.append(np.tile(stop_ids, logit_rows.size))
            pair_limits.append(np.full(logit_rows.size * stop_ids.size, states.min_tokens_host[row], dtype=np.int64))
        if not pair_rows:
            return logits
        device, pin = logits.device, states.pin_memory
        pair_rows_dev = host_to_device(np.concatenate(pair_rows), device, pin)
        pair_tokens_dev = host_to_device(np.concatenate(pair_tokens), device, pin)
        limits = host_to_device(np.concatenate(pair_limits), device, pin)
        table_rows = row_of_logit[pair_rows_dev]
        output_index = (num_tokens[table_rows] - num_prompt_tokens[table_rows]).long() + \
            layout.device["j_of_row"][pair_rows_dev]
        current = logits[pair_rows_dev, pair_tokens_dev]
        banned = torch.where(output_index < limits, torch.full_like(current, float("-inf")), current)
        return logits.index_put((pair_rows_dev, pair_tokens_dev), banned)
