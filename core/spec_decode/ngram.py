"""``ngram`` (prompt lookup): drafts copied from the request's own tokens, on the device.

After a step has appended its tokens, each request that sampled looks for its last ``n`` tokens
(``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in its tokens, prompt
and output alike. Of the occurrences of the longest suffix found, the latest one followed by
``num_speculative_tokens`` known tokens wins (recent text predicts best), else the earliest (in a
text that repeats itself the latest occurrences sit right before the suffix, with few tokens
after them); the tokens that followed it there (up to ``num_speculative_tokens``) are the drafts.
A request with no match gets no drafts (``num_drafts`` 0): its next step verifies none of the
slots it was scheduled.

Runs as torch ops on the request table's device tensors, with shapes from host integers alone
(the longest row the host knows of), so it never synchronises; on CUDA one Triton launch
(``weir.kernels.triton_ngram``, this code its oracle) does the same work in place of the well
over a hundred small ops.
"""

from __future__ import annotations

import torch

from weir.kernels.dispatch import triton_module, use_triton


def propose_ngram(
    token_ids: torch.Tensor,  # [R, max_model_len] int32: the request table's tokens
    num_tokens: torch.Tensor,  # [R] known tokens per row (after this step's tokens were appended)
    rows: torch.Tensor,  # [M] int64: rows that sampled this step
    max_len: int,  # host bound on num_tokens[rows]
    min_n: int,
    max_n: int,
    num_drafts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns drafts [M, num_drafts] (0 where none) and how many each row has [M]."""
    device = token_ids.device
    max_len = max(1, min(max_len, token_ids.shape[1]))
    history = token_ids[rows, :max_len].long()  # [M, L]
    lengths = num_tokens[rows].long().clamp_max(max_len)  # [M]
    num_rows = rows.shape[0]
    starts = torch.arange(max_len, device=device)  # [L]
    best_end = torch.full((num_rows,), -1, dtype=torch.long, device=device)  # index after the match
    for n in range(min(max_n, max_len - 1), min_n - 1, -1):  # an n-gram needs a token after it
        suffix_at = (lengths.unsqueeze(1) - n + torch.arange(n, device=device)).clamp_min(0)  # [M, n]
        suffix = history.gather(1, suffix_at)  # [M, n]
        windows = history.unfold(1, n, 1)  # [M, L - n + 1, n]
        matches = (windows == suffix.unsqueeze(1)).all(dim=-1)  # [M, L - n + 1]
        # An earlier occurrence with at least one known token after it (not the suffix itself).
        window_starts = starts[: max_len - n + 1]
        usable = window_starts.unsqueeze(0) + n < lengths.unsqueeze(1)
        matches &= usable & (lengths.unsqueeze(1) > n)
        full = matches & (window_starts.unsqueeze(0) + n + num_drafts <= lengths.unsqueeze(1))
        latest_full = torch.where(full, window_starts + 1, 0).amax(dim=1) - 1  # [M], -1: none
        earliest = torch.where(matches, window_starts, max_len).amin(dim=1)  # [M], max_len: none
        start = torch.where(latest_full >= 0, latest_full, earliest)
        found = (start < max_len) & (best_end < 0)
        best_end = torch.where(found, start + n, best_end)
    offsets = torch.arange(num_drafts, device=device)  # [K]
    draft_at = best_end.unsqueeze(1) + offsets  # [M, K]
    available = (best_end >= 0).unsqueeze(1) & (draft_at < lengths.unsqueeze(1))
    drafts = torch.where(available, history.gather(1, draft_at.clamp(0, max_len - 1)), 0)
    return drafts, available.sum(dim=1)


class NgramProposer:
    """Writes each sampled row's drafts into the request table, after its known tokens."""

    num_lookahead_tokens = 0  # drafts are verified, never computed ahead
    runs_without_samples = False  # a step that sampled nothing leaves it nothing to look up

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, table, rows: torch.Tensor, max_len: int, **_) -> None:
        if use_triton(table.token_ids.gpu):
            triton_module("triton_ngram").propose_ngram_triton(
                table.token_ids.gpu, table.num_tokens.gpu, table.num_drafts.gpu, rows, max_len, self.min_n,
                self.max_n, self.num_speculative_tokens)
            return
        drafts, counts = propose_ngram(table.token_ids.gpu, table.num_tokens.gpu, rows, max_len, self.min_n,
                                       self.max_n, self.num_speculative_tokens)
        write_drafts(table, rows, drafts, counts)


def write_drafts(table, rows: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor) -> None:
    """``drafts [M, K]`` into ``token_ids[row, num_tokens[row]:]`` (all K columns inside
    max_model_len, those past a row's count too: the n-gram proposer's zeros there) and their
    number into ``table.num_drafts``. ``rows`` must be distinct: the writes add deltas."""
    token_ids = table.token_ids.gpu
    max_model_len = token_ids.shape[1]
    start = table.num_tokens.gpu[rows].long()  # [M]
    columns = start.unsqueeze(1) + torch.arange(drafts.shape[1], device=rows.device)  # [M, K]
    inside = columns < max_model_len
    counts = torch.minimum(counts.long(), (max_model_len - start).clamp_min(0))
    flat = (rows.unsqueeze(1) * max_model_len + columns.clamp_max(max_model_len - 1)).reshape(-1)
    flat_tokens = token_ids.view(-1)
    # Deltas through index_add: slots past max_model_len alias its last column, and add nothing.
    current = flat_tokens[flat].view_as(drafts)
    delta = torch.where(inside, drafts.to(token_ids.dtype) - current, 0)
    flat_tokens.index_add_(0, flat, delta.reshape(-1))
    table.num_drafts.gpu.index_copy_(0, rows, counts.to(table.num_drafts.gpu.dtype))
