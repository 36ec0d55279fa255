"""Torch reference ops of the sampler: banned tokens, penalties, temperature, min-p, top-k/top-p
and counter-based Gumbel noise.

Each op takes ``[num_rows, vocab]`` fp32 logits plus per-row parameter tensors and returns new
logits. None of them reads a device value on the host: a step never waits on the device here.
They are the reference of the Triton sampler (``weir.sample.triton_sampler``,
``triton_sample_filters`` and ``triton_penalties``), which draws the same noise from the
constants below, and the path on every device Triton does not serve.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# The largest fp32 below 1.0: keeps the uniform strictly inside (0, 1) after rounding.
LARGEST_BELOW_ONE = 1.0 - 2.0**-24
# The noise hash's constants, shared with the Triton sampler (weir.sample.triton_sampler),
# which must draw the same numbers: murmur3's finaliser multipliers, then the salts and
# multipliers that mix the seed's high half, the position and the token id into the key.
FMIX_MULTIPLIER_1 = 0x85EBCA6B
FMIX_MULTIPLIER_2 = 0xC2B2AE35
SEED_HIGH_SALT = 0x6A09E667
POSITION_MULTIPLIER = 0x9E3779B9
TOKEN_MULTIPLIER = 0xBB67AE85
TOKEN_SALT = 0x3C6EF372


def apply_banned_tokens(logits: torch.Tensor, banned: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Force ``logits[row_idx[i], token_id[i]]`` to -inf (e.g. EOS before ``min_tokens``)."""
    row_idx, token_id = banned  # [num_banned] int64 each
    # new_full fills on the device: no host-to-device copy of the -inf scalar.
    return logits.index_put((row_idx, token_id), logits.new_full((), float("-inf")))


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab] fp32
    prompt_token_mask: torch.Tensor | None,  # [num_rows, vocab] bool
    output_token_counts: torch.Tensor,  # [num_rows, vocab] int32
    repetition_penalty: torch.Tensor,  # [num_rows] fp32, 1 = off
    frequency_penalty: torch.Tensor,  # [num_rows] fp32, 0 = off
    presence_penalty: torch.Tensor,  # [num_rows] fp32, 0 = off
) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens, then frequency/presence over output.

    Repetition shrinks a seen token's logit towards "less likely" whatever its sign: positive
    logits are divided by the penalty, negative ones multiplied.
    """
    output_seen = output_token_counts > 0  # [num_rows, vocab]
    seen = output_seen if prompt_token_mask is None else output_seen | prompt_token_mask
    repetition = repetition_penalty.unsqueeze(1)  # [num_rows, 1]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    counts = output_token_counts.to(logits.dtype)
    logits = logits - frequency_penalty.unsqueeze(1) * counts
    return logits - presence_penalty.unsqueeze(1) * output_seen.to(logits.dtype)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature; greedy rows (temperature 0) are left as they are."""
    divisor = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [num_rows]
    return logits / divisor.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's largest probability.

    Compared in log space (logit < max_logit + log(min_p)), which needs no softmax; min_p 0
    gives a threshold of -inf and masks nothing.
    """
    max_logit = logits.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    threshold = max_logit + torch.log(min_p).unsqueeze(1)  # [num_rows, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab] fp32
    top_k: torch.Tensor | None,  # [num_rows] int32, 0 = off; None = no row uses top-k
    top_p: torch.Tensor | None,  # [num_rows] fp32, 1 = off; None = no row uses top-p
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then its smallest set with mass >= ``top_p``.

    One ascending sort serves both. Tokens tied with the k-th largest logit are kept too.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_token_ids = logits.sort(dim=-1)  # ascending, [num_rows, vocab]
    if top_k is not None:
        keep_count = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size).long()
        kth_largest = sorted_logits.gather(1, (vocab_size - keep_count).unsqueeze(1))  # [num_rows, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, vocab]
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_token_ids, sorted_logits)


def _mul32(value: torch.Tensor, constant: int) -> torch.Tensor:
    """``value * constant mod 2**32`` for 32-bit lanes held in int64, without int64 overflow."""
    low = value * (constant & 0xFFFF)  # < 2**48
    high = ((value * (constant >> 16)) & 0xFFFF) << 16  # only the bits that land below 2**32
    return (low + high) & _MASK32


def _fmix32(value: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser: a bijection on 32-bit lanes with full avalanche."""
    value = value ^ (value >> 16)
    value = _mul32(value, FMIX_MULTIPLIER_1)
    value = value ^ (value >> 13)
    value = _mul32(value, FMIX_MULTIPLIER_2)
    return value ^ (value >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), one per (row, token), a pure function of (seed, position, token_id).

    Counter-based rather than a stateful generator, so a seeded request draws the same numbers
    whatever else shares its batch and after a preemption recomputes it.
    """
    seed_low = seeds & _MASK32  # [num_rows]
    seed_high = (seeds >> 32) & _MASK32
    row_key = _fmix32(seed_low ^ _fmix32(seed_high ^ SEED_HIGH_SALT))
    row_key = _fmix32(row_key ^ _mul32(positions & _MASK32, POSITION_MULTIPLIER))  # [num_rows]
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [vocab]
    token_key = _mul32(token_ids, TOKEN_MULTIPLIER) ^ TOKEN_SALT  # [vocab]
    lanes = _fmix32(_fmix32(row_key.unsqueeze(1) ^ token_key.unsqueeze(0)))  # [num_rows, vocab]
    mantissa = (lanes >> 8).to(torch.float32)  # 24 random bits, exact in fp32
    uniform = (mantissa + 0.5) * 2.0**-24
    # The top mantissa rounds to exactly 1.0 in fp32 (tie to even); log(1) would give inf noise.
    return uniform.clamp_(max=LARGEST_BELOW_ONE)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of shape [num_rows, vocab], fp32."""
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab_size)))
