"""Triton filter thresholds of the sampler: min-p, top-k and top-p without sorting.

Each filter keeps "every token at or above some value" of the temperature-scaled logits, so one
threshold per row replaces the sort of the torch op (``ops.apply_top_k_top_p``, the oracle).
``_filter_threshold_kernel`` runs one program per batch row, reading its parameters at its
sampler row (``idx_mapping[row]``); a random row takes a pass for the maximum (min-p's
threshold is closed form), then for top-k and top-p a search on the value axis. Each search pass
scores ``SEARCH_SLOTS`` evenly spaced thresholds at once (how many tokens, how much probability
lie at or above each) and keeps the sub-interval that holds the answer, until it holds a single
token: a few passes over the row instead of a sort of it.

Top-k keeps the ties of the k-th largest, as the torch op does; top-p keeps every token tied
with its boundary token (the sort keeps an arbitrary subset of such a tie). Nothing reads a
device value on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.sample.metadata import SamplingMetadata

# Tokens per loop step, thresholds scored per pass (each pass narrows the interval that many
# times), warps: 512 x 8 with 8 warps takes about 90 registers a thread (2 rows per SM).
SEARCH_BLOCK = 512
SEARCH_SLOTS = 8
SEARCH_WARPS = 8
MAX_SEARCH_PASSES = 48  # 8**48 spans any fp32 range; ties stop the search earlier


@triton.jit
def _scaled_logits(row_ptr, tokens, vocab_size, temperature):
    """``logits / temperature`` as ``ops.apply_temperature`` rounds it; -inf past the vocabulary."""
    logits = tl.load(row_ptr + tokens, mask=tokens < vocab_size, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(logits, temperature)


@triton.jit
def _search_threshold(row_ptr, vocab_size, temperature, floor, lowest, row_max, top_k, top_p,
                      BY_MASS: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
                      MAX_PASSES: tl.constexpr):
    """The largest token value ``t`` with ``count(v >= t) >= top_k`` (``BY_MASS`` False) or
    ``mass(v >= t) >= top_p`` (True), among the tokens ``v >= floor``; the lowest survivor when
    none qualifies. Keeping ``v >= t`` is exactly top-k (ties kept) or top-p.

    Invariant: the answer lies in ``[lo, hi)``; ``hi`` never qualifies and ``count_hi`` tokens
    lie at or above it. A pass scores ``NUM_SLOTS`` thresholds spread over ``[lo, hi)`` and
    finds the range of the values inside it, which bounds the next interval too.
    """
    slots = tl.arange(0, NUM_SLOTS)  # [NUM_SLOTS]
    fractions = slots.to(tl.float32) * (1.0 / NUM_SLOTS)
    lo = tl.maximum(floor, lowest)
    if BY_MASS:
        # The maximum survives every filter, so the total mass is >= 1 (unnormalised) and the
        # tokens below row_max - log(V / (1 - top_p)) hold under 1 - top_p of it: the answer
        # is above that. The + 1 is slack for rounding.
        lo = tl.maximum(lo, row_max - tl.log(vocab_size / (1.0 - top_p)) - 1.0)
    hi = row_max + tl.abs(row_max) * 1e-6 + 1e-30  # just above the maximum: nothing reaches it
    count_hi = tl.full([], 0, tl.int32)
    target = top_k.to(tl.float32)  # top-p's target, top_p * total mass, is known after pass 0
    passes = tl.full([], 0, tl.int32)
    searching = lo < hi
    while searching:
        candidates = lo + (hi - lo) * fractions  # [NUM_SLOTS], candidates[0] == lo
        # Per-lane partial sums, reduced once after the pass: no cross-thread work per block.
        lane_counts = tl.zeros([NUM_SLOTS, BLOCK], dtype=tl.int32)
        lane_masses = tl.zeros([NUM_SLOTS, BLOCK], dtype=tl.float32)
        lane_totals = tl.zeros([BLOCK], dtype=tl.float32)
        # The smallest and largest value inside [lo, hi): they bound the answer more tightly.
        lane_inside_min = tl.full([BLOCK], float("inf"), tl.float32)
        lane_inside_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for block_start in range(0, vocab_size, BLOCK):
            tokens = block_start + tl.arange(0, BLOCK)
            values = _scaled_logits(row_ptr, tokens, vocab_size, temperature)  # [BLOCK]
            values = tl.where(values >= floor, values, float("-inf"))  # earlier filters' losers
            inside = (values >= lo) & (values < hi)
            lane_inside_min = tl.minimum(lane_inside_min, tl.where(inside, values, float("inf")))
            lane_inside_max = tl.maximum(lane_inside_max, tl.where(inside, values, float("-inf")))
            at_or_above = values[None, :] >= candidates[:, None]  # [NUM_SLOTS, BLOCK]
            lane_counts += at_or_above.to(tl.int32)
            if BY_MASS:
                weights = tl.exp(values - row_max)  # unnormalised probabilities, [BLOCK]
                lane_totals += weights
                lane_masses += tl.where(at_or_above, weights[None, :], 0.0)
        counts = tl.sum(lane_counts, axis=1)  # [NUM_SLOTS]: tokens at or above each candidate
        if BY_MASS:
            masses = tl.sum(lane_masses, axis=1)
            target = tl.where(passes == 0, top_p * tl.sum(lane_totals, axis=0), target)
            qualifies = masses >= target
        else:
            qualifies = counts.to(tl.float32) >= target
        lo_qualifies = tl.sum(tl.where(slots == 0, qualifies.to(tl.int32), 0), axis=0) > 0
        best = tl.max(tl.where(qualifies, slots, 0), axis=0)  # the highest qualifying slot
        new_lo = tl.sum(tl.where(slots == best, candidates, 0.0), axis=0)
        count_lo = tl.sum(tl.where(slots == best, counts, 0), axis=0)
        has_next = best + 1 < NUM_SLOTS
        new_hi = tl.where(has_next, tl.sum(tl.where(slots == best + 1, candidates, 0.0), axis=0), hi)
        count_hi = tl.where(has_next, tl.sum(tl.where(slots == best + 1, counts, 0), axis=0), count_hi)
        # The answer is a token value in [lo, hi), so in [inside_min, inside_max]: snap the new
        # interval to it (no token lies in between, so the counts at its ends are unchanged).
        inside_min = tl.min(lane_inside_min, axis=0)
        inside_max = tl.max(lane_inside_max, axis=0)
        any_inside = inside_min <= inside_max
        new_lo = tl.where(any_inside, tl.maximum(new_lo, inside_min), new_lo)
        just_above_max = inside_max + tl.abs(inside_max) * 2.5e-7 + 1e-37  # > inside_max in fp32
        new_hi = tl.where(any_inside, tl.minimum(new_hi, just_above_max), new_hi)
        passes += 1
        progressed = (new_lo != lo) | (new_hi != hi)
        # Done when [lo, hi) holds one token, or one value (a tie no threshold can split).
        searching = (lo_qualifies & (count_lo - count_hi > 1) & (inside_min < inside_max) & progressed
                     & (passes < MAX_PASSES))
        lo = new_lo
        hi = new_hi
    return lo


@triton.jit
def _filter_threshold_kernel(
    logits_ptr, logits_stride,  # [B, V] fp32
    idx_mapping_ptr,  # [B] int64: the sampler row of each batch row
    temperature_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr,  # [R] each, read at the sampler row
    threshold_ptr,  # [B] fp32 (out): keep scaled logits >= threshold
    vocab_size,
    HAS_MIN_P: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr, MAX_PASSES: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    req = tl.load(idx_mapping_ptr + row)
    temperature = tl.load(temperature_ptr + req)
    top_k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    threshold = tl.full([], float("-inf"), tl.float32)
    if (temperature != 0.0) & (top_k != 1):  # greedy rows ignore every filter
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_lowest = tl.full([BLOCK], float("inf"), tl.float32)  # the smallest finite values
        for block_start in range(0, vocab_size, BLOCK):
            values = _scaled_logits(row_ptr, block_start + tl.arange(0, BLOCK), vocab_size, temperature)
            lane_max = tl.maximum(lane_max, values)
            lane_lowest = tl.minimum(lane_lowest, tl.where(values > float("-inf"), values, float("inf")))
        row_max = tl.max(lane_max, axis=0)
        lowest = tl.min(lane_lowest, axis=0)
        if HAS_MIN_P:
            threshold = row_max + tl.load(log_min_p_ptr + req)  # ops.apply_min_p's threshold
        if HAS_TOP_K:
            if (top_k > 0) & (top_k < vocab_size):
                threshold = _search_threshold(row_ptr, vocab_size, temperature, threshold, lowest, row_max,
                                              top_k, top_p, False, NUM_SLOTS, BLOCK, MAX_PASSES)
        if HAS_TOP_P:
            if top_p < 1.0:
                threshold = _search_threshold(row_ptr, vocab_size, temperature, threshold, lowest, row_max,
                                              top_k, top_p, True, NUM_SLOTS, BLOCK, MAX_PASSES)
    tl.store(threshold_ptr + row, threshold)


def filter_thresholds_triton(
    logits: torch.Tensor,  # [num_rows, vocab] fp32, last stride 1
    metadata: SamplingMetadata,
    block: int = SEARCH_BLOCK,
    num_slots: int = SEARCH_SLOTS,
    num_warps: int = SEARCH_WARPS,
) -> torch.Tensor | None:
    """``[num_rows]`` fp32: each random row keeps the scaled logits at or above its entry.

    None when no row uses min-p, top-k or top-p. Greedy rows get -inf. ``block``, ``num_slots``
    (powers of two) and ``num_warps`` only change the speed
    (benchmarks/kernel_bench/bench_small_ops.py sweeps them).
    """
    if metadata.no_min_p and metadata.no_top_k and metadata.no_top_p:
        return None
    num_rows, vocab_size = logits.shape
    thresholds = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    # log_min_p is torch's log, not Triton's: the min-p threshold must round as ops.apply_min_p's.
    _filter_threshold_kernel[(num_rows,)](
        logits, logits.stride(0), metadata.idx_mapping,
        metadata.temperature, metadata.top_k, metadata.top_p, metadata.log_min_p,
        thresholds, vocab_size,
        HAS_MIN_P=not metadata.no_min_p, HAS_TOP_K=not metadata.no_top_k, HAS_TOP_P=not metadata.no_top_p,
        NUM_SLOTS=num_slots, BLOCK=block, MAX_PASSES=MAX_SEARCH_PASSES, num_warps=num_warps,
    )
    return thresholds
