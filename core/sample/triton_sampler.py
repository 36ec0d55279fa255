"""Triton token choice of the sampler: one fused Gumbel-max pass, no [B, V] temporaries.

The torch sampler (``weir.sample``) is the oracle. ``_gumbel_argmax_kernel`` computes, per batch
row (split over the vocabulary when the batch is small), the argmax of ``logits / temperature +
gumbel(seed, position, token)`` over the tokens at or above the row's filter threshold
(``weir.sample.triton_sample_filters``), with the noise hash of ``ops.uniform_noise`` computed
in registers. Each batch row reads its parameters at its sampler row, ``idx_mapping[row]``.
Greedy rows (temperature 0 or top-k 1) take the plain argmax of the raw logits in the same
launch. Ties resolve to the lowest token id, as ``torch.argmax``.

Division is IEEE (``div_rn``) and ``tl.log`` is libdevice's, as torch's CUDA kernels use, so
scores should equal torch's on CUDA bit for bit. Grids come from tensor shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.sample import ops
from weir.sample.metadata import SamplingMetadata
from weir.sample.triton_sample_filters import filter_thresholds_triton

FMIX_MULTIPLIER_1: tl.constexpr = tl.constexpr(ops.FMIX_MULTIPLIER_1)
FMIX_MULTIPLIER_2: tl.constexpr = tl.constexpr(ops.FMIX_MULTIPLIER_2)
SEED_HIGH_SALT: tl.constexpr = tl.constexpr(ops.SEED_HIGH_SALT)
POSITION_MULTIPLIER: tl.constexpr = tl.constexpr(ops.POSITION_MULTIPLIER)
TOKEN_MULTIPLIER: tl.constexpr = tl.constexpr(ops.TOKEN_MULTIPLIER)
TOKEN_SALT: tl.constexpr = tl.constexpr(ops.TOKEN_SALT)
LARGEST_BELOW_ONE: tl.constexpr = tl.constexpr(ops.LARGEST_BELOW_ONE)
# Bounds of the Gumbel draws: -log(-log(LARGEST_BELOW_ONE)) = 16.64 and -log(-log(2**-25)) =
# -2.85, widened for rounding. A block whose best value plus the upper bound is below a lower
# bound of the running best (a best value plus the lower bound) cannot win: it needs no noise.
GUMBEL_MAX: tl.constexpr = tl.constexpr(17.0)
GUMBEL_MIN: tl.constexpr = tl.constexpr(-3.0)
GUMBEL_BLOCK = 1024
GUMBEL_WARPS = 4
GUMBEL_PROGRAMS_PER_SM = 16  # H200 sweep (bench_small_ops.py): 194 vs 233 us at batch 256


@triton.jit
def _fmix32(value):
    """murmur3's 32-bit finaliser on uint32 lanes (``ops._fmix32``)."""
    value ^= value >> 16
    value = value * FMIX_MULTIPLIER_1
    value ^= value >> 13
    value = value * FMIX_MULTIPLIER_2
    value ^= value >> 16
    return value


@triton.jit
def _noise_row_key(seed, position):
    """``ops.uniform_noise``'s per-row key from an int64 seed and position."""
    seed_low = seed.to(tl.uint32)  # truncation keeps the low 32 bits
    seed_high = (seed >> 32).to(tl.uint32)
    key = _fmix32(seed_low ^ _fmix32(seed_high ^ SEED_HIGH_SALT))
    return _fmix32(key ^ (position.to(tl.uint32) * POSITION_MULTIPLIER))


@triton.jit
def _gumbel_noise(row_key, token_ids):
    """Gumbel noise of ``token_ids`` ([BLOCK] int32) under ``row_key``: ``ops.gumbel_noise``."""
    token_key = token_ids.to(tl.uint32) * TOKEN_MULTIPLIER ^ TOKEN_SALT
    lanes = _fmix32(_fmix32(row_key ^ token_key))
    mantissa = (lanes >> 8).to(tl.float32)  # 24 random bits, exact in fp32
    uniform = tl.minimum((mantissa + 0.5) * 5.9604644775390625e-08, LARGEST_BELOW_ONE)  # * 2**-24
    return -tl.log(-tl.log(uniform))


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr, logits_stride,  # [B, V] fp32
    idx_mapping_ptr,  # [B] int64: the sampler row of each batch row
    temperature_ptr, top_k_ptr, seeds_ptr,  # [R] each, read at the sampler row
    positions_ptr,  # [B]
    threshold_ptr,  # [B] fp32, read when HAS_THRESHOLD
    best_score_ptr, best_token_ptr,  # [B, num_splits] fp32 / int64 (out)
    vocab_size, tokens_per_split,
    HAS_THRESHOLD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    req = tl.load(idx_mapping_ptr + row)
    temperature = tl.load(temperature_ptr + req)
    greedy = (temperature == 0.0) | (tl.load(top_k_ptr + req) == 1)
    row_key = _noise_row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + row))
    threshold = tl.full([], float("-inf"), tl.float32)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, vocab_size)
    # Per-lane running best (the earliest token on ties), reduced once at the end.
    lane_scores = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_tokens = split_start + tl.arange(0, BLOCK)
    # A lower bound on the best score so far: the best value plus the smallest possible noise.
    best_bound = tl.full([], float("-inf"), tl.float32)
    for block_start in range(split_start, split_end, BLOCK):
        tokens = block_start + tl.arange(0, BLOCK)  # [BLOCK]
        in_split = tokens < split_end
        logits = tl.load(row_ptr + tokens, mask=in_split, other=float("-inf")).to(tl.float32)
        if greedy:
            scores = logits
        else:
            values = tl.math.div_rn(logits, temperature)  # -inf past the split stays -inf
            values = tl.where(values >= threshold, values, float("-inf"))
            scores = values
            block_max = tl.max(values, axis=0)
            if block_max + GUMBEL_MAX >= best_bound:  # else no token of this block can win
                scores = values + _gumbel_noise(row_key, tokens)
                best_bound = tl.maximum(best_bound, block_max + GUMBEL_MIN)
        improved = scores > lane_scores  # strict: a lane keeps its earliest maximum
        lane_tokens = tl.where(improved, tokens, lane_tokens)
        lane_scores = tl.where(improved, scores, lane_scores)
    best_score = tl.max(lane_scores, axis=0)
    # Among lanes holding the best score, the lowest token id, as torch.argmax picks.
    best_token = tl.min(tl.where(lane_scores == best_score, lane_tokens, vocab_size), axis=0)
    out = row * num_splits + split
    tl.store(best_score_ptr + out, best_score)
    tl.store(best_token_ptr + out, best_token.to(tl.int64))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_tokens_triton(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    programs_per_sm: int = GUMBEL_PROGRAMS_PER_SM,
    block: int = GUMBEL_BLOCK,
    num_warps: int = GUMBEL_WARPS,
) -> torch.Tensor:
    """``Sampler.choose_tokens`` for logits ``[num_rows, vocab]`` fp32: ``[num_rows]`` int64.

    The launch shape arguments exist for ``benchmarks/kernel_bench/bench_small_ops.py``'s sweep."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    thresholds = filter_thresholds_triton(logits, metadata)  # [num_rows] fp32, or None
    # Each program walks its split block by block, every block's load waiting on the one before:
    # the row count alone leaves too few programs in flight, so the vocabulary is split too.
    max_splits = triton.cdiv(vocab_size, block)
    num_splits = max(1, min(max_splits, triton.cdiv(programs_per_sm * _num_sms(logits.device), num_rows)))
    tokens_per_split = triton.cdiv(max_splits, num_splits) * block
    num_splits = triton.cdiv(vocab_size, tokens_per_split)
    best_scores = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)  # per split
    best_tokens = torch.empty(num_rows, num_splits, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), metadata.idx_mapping,
        metadata.temperature, metadata.top_k, metadata.seeds, metadata.positions,
        thresholds if thresholds is not None else metadata.temperature,
        best_scores, best_tokens, vocab_size, tokens_per_split,
        HAS_THRESHOLD=thresholds is not None, BLOCK=block, num_warps=num_warps,
    )
    if num_splits == 1:
        return best_tokens[:, 0]
    best_split = best_scores.argmax(dim=1, keepdim=True)  # [num_rows, 1]: the first on ties
    return best_tokens.gather(1, best_split).squeeze(1)
