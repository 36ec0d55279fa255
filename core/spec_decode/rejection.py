"""Rejection sampling of drafts against the target's distribution, all on the device.

For one request with drafts ``d_1..d_k`` the target gives logits at ``k + 1`` positions: row
``j`` is the distribution of the token after ``d_j`` (row 0: after the last token the host
knows). Row ``j < k`` verifies ``d_{j+1}``:

- greedy rows accept it when it is the argmax of the row (after bans and penalties): the
  emitted tokens are then exactly greedy decoding's;
- random rows accept it with probability ``min(1, p(d) / q(d))`` (``p``: the row's processed
  target distribution, after temperature, min-p, top-k/top-p; ``q``: the draft's);
- at the first rejection the step emits a token drawn from the residual ``max(p - q, 0)``
  normalised, and when every draft is accepted (or the drafts ran out before row ``k``: an
  n-gram shorter than ``k``) a token drawn from ``p`` of the next row.

Draws are Gumbel-max with the sampler's own noise for that (seed, position). With one-hot drafts
(deterministic proposers: n-gram, greedy drafts) a random row takes the plain draw ``x`` and
accepts ``d`` exactly when ``x == d``: the probability is ``p(d)``, and ``x`` given ``x != d``
follows the residual. So every token a seeded request emits is the token sampling without drafts
gives at that (seed, position), whatever else shares the batch and however many drafts the
token budget let a step verify. With a draft distribution ``q`` (no proposer passes one yet:
every proposer drafts one-hot) the acceptance test takes a uniform keyed on (seed, position);
the tokens then follow the target exactly (Leviathan et al., 2023), but a step that verified
fewer drafts (a smaller token budget left by the batch) may emit other ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weir.sample import ops

# Salts the seed of the acceptance uniforms, so they are independent of the Gumbel noise drawn
# at the same (seed, position).
ACCEPT_SEED_SALT = 0x2545F4914F6CDD1D


@dataclass
class RejectionOutput:
    emitted: torch.Tensor  # [B, S] int64: accepted drafts, then the sampled token; -1 after
    num_accepted: torch.Tensor  # [B] int64
    num_verified: torch.Tensor  # [B] int64: drafts that existed and were checked
    emitted_per_row: torch.Tensor  # [N] int64: the token emitted at each logits row (its prefix kept or not)


def acceptance_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, keyed on (seed, position) apart from the Gumbel noise."""
    salted = seeds ^ ACCEPT_SEED_SALT  # a Python scalar: no host-to-device copy
    return ops.uniform_noise(salted, positions, 1)[:, 0]  # [N]


def rejection_sample(
    processed_logits: torch.Tensor | None,  # [N, V] fp32: temperature, min-p, top-k/p applied (None: all greedy)
    greedy_tokens: torch.Tensor,  # [N] int64: argmax of each row after bans and penalties
    is_greedy: torch.Tensor,  # [N] bool
    draft_tokens: torch.Tensor,  # [N] int64: the draft row i verifies (any value where there is none)
    draft_probs: torch.Tensor | None,  # [N, V] fp32 q of each verified draft; None: one-hot drafts
    seeds: torch.Tensor,  # [N] int64
    positions: torch.Tensor,  # [N] int64: tokens before the one row i samples
    flat_of: torch.Tensor,  # [B, S] int64: logits row of (request, j), clamped to the request's last row
    num_valid: torch.Tensor,  # [B] int64: drafts each request has (<= its scheduled drafts, <= S - 1)
) -> RejectionOutput:
    num_reqs, width = flat_of.shape
    device = greedy_tokens.device
    sampled = greedy_tokens  # [N]: the token each row emits when no draft is taken there
    residual = greedy_tokens  # [N]: the token each row emits when its draft is rejected
    accept = draft_tokens == greedy_tokens  # [N]
    if processed_logits is not None:
        noise = ops.gumbel_noise(seeds, positions, processed_logits.shape[-1])  # [N, V]
        random_sampled = (processed_logits + noise).argmax(dim=-1)  # [N]
        if draft_probs is None:
            # One-hot drafts: accept d exactly when the plain draw x is d (probability p(d), the
            # min(1, p(d) / q(d)) of q one-hot), else emit x, which given x != d follows the
            # residual. Every emitted token is then the one sampling without drafts gives at that
            # (seed, position), however many drafts the step happened to verify there.
            random_accept = random_sampled == draft_tokens
            random_residual = random_sampled
        else:
            safe_draft = draft_tokens.clamp(0, processed_logits.shape[-1] - 1).unsqueeze(1)  # [N, 1]
            probs = processed_logits.softmax(dim=-1)  # [N, V]
            p_draft = probs.gather(1, safe_draft).squeeze(1)  # [N]
            q_draft = draft_probs.gather(1, safe_draft).squeeze(1)
            ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-30), 1.0)
            # Where p and q agree to rounding the residual is empty; p itself is then the fallback.
            residual_probs = (probs - draft_probs).clamp_min(0)
            empty = residual_probs.sum(dim=-1, keepdim=True) <= 0
            residual_logits = torch.where(empty, processed_logits, residual_probs.log())
            random_residual = (residual_logits + noise).argmax(dim=-1)
            random_accept = acceptance_uniforms(seeds, positions) < ratio
        sampled = torch.where(is_greedy, greedy_tokens, random_sampled)
        residual = torch.where(is_greedy, greedy_tokens, random_residual)
        accept = torch.where(is_greedy, accept, random_accept)

    j = torch.arange(width - 1, device=device)  # [S - 1]
    verified = j.unsqueeze(0) < num_valid.unsqueeze(1)  # [B, S - 1]
    accepted_grid = accept[flat_of[:, :-1]] & verified  # [B, S - 1]
    num_accepted = accepted_grid.long().cumprod(dim=1).sum(dim=1)  # [B]: the leading run
    # Row j emits the draft it verified when it accepted it, else its residual draw (a rejected
    # draft) or its plain draw (no draft to verify).
    # Counted through index_add (no boolean-mask indexing: its size would need a host sync).
    draft_rows = torch.zeros(accept.shape[0], dtype=torch.int64, device=device)
    draft_rows.index_add_(0, flat_of[:, :-1].reshape(-1), verified.reshape(-1).long())
    has_draft = draft_rows > 0  # [N]
    emitted_per_row = torch.where(accept & has_draft, draft_tokens, torch.where(has_draft, residual, sampled))
    cols = torch.arange(width, device=device).unsqueeze(0)  # [1, S]
    emitted = torch.where(cols <= num_accepted.unsqueeze(1), emitted_per_row[flat_of], -1)  # [B, S]
    return RejectionOutput(emitted, num_accepted, num_valid, emitted_per_row)
