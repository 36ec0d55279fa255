"""The Triton sampler (weir.sample.triton_sampler, triton_sample_filters, triton_penalties)
against the torch sampler, its oracle.

Every ``check_*`` runs twice: on the CPU in Triton's interpreter (a subprocess, see
helpers_triton) and compiled on CUDA (marked gpu). Samples must match the torch path row for
row; a mismatch is tolerated only where the two best noisy scores are within float rounding,
and the mismatch rate must stay tiny. Filter sets must equal the torch masks exactly. Batch
rows sit at shuffled sampler rows of a larger sampler, so every kernel reads its parameters
through ``idx_mapping``.
"""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest
import torch

from helpers_triton import kernel_check_tests
from weir.kernels.dispatch import forced_torch_ops
from weir.sample import Sampler, ops
from weir.sampling_params import SamplingParams

KINDS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(top_p=0.85),
    SamplingParams(temperature=0.6, min_p=0.05),
    SamplingParams(top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0),
    SamplingParams(top_k=1, temperature=2.0),
    SamplingParams(temperature=0.5, top_p=0.2, top_k=300),
    SamplingParams(top_p=0.999, min_p=1.0),
]


def _kernels():
    from weir.sample import triton_sampler  # imports triton: only inside a check

    return triton_sampler


def _penalty_kernels():
    from weir.sample import triton_penalties  # imports triton: only inside a check

    return triton_penalties


def _logits(num_rows, vocab, device, scale=3.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab, generator=generator) * scale).to(device)


def _shuffled_sampler(params, seeds, vocab, device, salt=0, spare_rows=3, **token_ids):
    """A sampler of ``len(params) + spare_rows`` rows holding ``params[i]`` at row ``rows[i]``
    (shuffled, some rows left empty); returns it with (idx_mapping, rows) of that batch."""
    num_rows = len(params)
    rows = random.Random(salt).sample(range(num_rows + spare_rows), num_rows)
    sampler = Sampler(num_rows + spare_rows, vocab, device, pin_memory=False)
    prompts = token_ids.get("prompt_token_ids", [[]] * num_rows)
    outputs = token_ids.get("output_token_ids", [[]] * num_rows)
    for row, p, seed, prompt, output in zip(rows, params, seeds, prompts, outputs):
        sampler.add_request(row, p, seed, prompt, output, p.stop_token_ids)
    sampler.apply_staged_writes()
    return sampler, torch.tensor(rows, device=device), np.array(rows)


def _metadata(params, vocab, device, salt=0, min_tokens=(), **token_ids):
    # Negative seeds, seeds past 2**32 and large positions all reach the hash.
    seeds = [(salt + 7919 * row) * 2**40 * (-1 if row % 3 == 0 else 1) + row for row in range(len(params))]
    positions = torch.tensor([(salt + 37 * row) % 100000 for row in range(len(params))], device=device)
    sampler, idx_mapping, rows = _shuffled_sampler(params, seeds, vocab, device, salt, **token_ids)
    return sampler.batch_metadata(idx_mapping, rows, positions, min_tokens)


def _torch_filtered(logits, metadata):
    """The torch sampler's filtered, temperature-scaled logits (-inf where a filter drops)."""
    metadata = metadata.gathered()
    filtered = ops.apply_temperature(logits, metadata.temperature)
    if not metadata.no_min_p:
        filtered = ops.apply_min_p(filtered, metadata.min_p)
    return ops.apply_top_k_top_p(filtered, None if metadata.no_top_k else metadata.top_k,
                                 None if metadata.no_top_p else metadata.top_p)


def _torch_tokens(logits, metadata):
    with forced_torch_ops():
        return Sampler(1, logits.shape[1], logits.device, pin_memory=False).choose_tokens(logits, metadata)


def _assert_same_samples(logits, metadata, max_mismatch_rate=0.002):
    """Kernel tokens == torch tokens, except near-ties of the noisy scores (rare, measured)."""
    ours = _kernels().choose_tokens_triton(logits, metadata).cpu()
    reference = _torch_tokens(logits, metadata).cpu()
    assert ours.dtype == torch.int64 and ours.shape == reference.shape
    batch = metadata.gathered()
    greedy = ((batch.temperature == 0) | (batch.top_k == 1)).cpu()
    assert torch.equal(ours[greedy], reference[greedy])  # greedy rows: identical, always
    mismatched = (ours != reference).nonzero().flatten().tolist()
    if mismatched:
        scores = (_torch_filtered(logits, metadata) + ops.gumbel_noise(
            batch.seeds, batch.positions, logits.shape[1])).cpu()
        for row in mismatched:
            ours_score, reference_score = scores[row, ours[row]], scores[row, reference[row]]
            assert torch.isfinite(ours_score), f"row {row}: sampled a filtered token {ours[row]}"
            gap = (reference_score - ours_score).abs().item()
            assert gap <= 1e-5 * max(1.0, reference_score.abs().item()), f"row {row}: score gap {gap}"
    assert len(mismatched) <= max(1, max_mismatch_rate * len(ours)), mismatched


def check_mixed_batch_matches_torch(device):
    params = [KINDS[row % len(KINDS)] for row in range(36)]
    for salt, vocab in ((0, 1500), (1, 500)):
        logits = _logits(len(params), vocab, device, seed=salt)
        _assert_same_samples(logits, _metadata(params, vocab, device, salt))


def check_noise_matches_the_torch_hash(device):
    # Flat logits: the sample is the argmax of the noise itself, over many seeds and positions.
    num_rows, vocab = 128, 1024
    metadata = _metadata([SamplingParams()] * num_rows, vocab, device, salt=5)
    _assert_same_samples(torch.zeros(num_rows, vocab, device=device), metadata)


def check_filter_sets_equal_the_torch_masks(device):
    params = [
        SamplingParams(top_k=k, top_p=p, min_p=m, temperature=t)
        for k in (0, 1, 2, 25, 1999, 5000) for p in (1.0, 0.95, 0.5, 0.05) for m in (0.0, 0.2) for t in (0.7,)
        if k != 1
    ]
    vocab = 2000
    logits = _logits(len(params), vocab, device, scale=2.0, seed=3)  # no ties, no underflow
    logits[::4, :10] = float("-inf")  # banned tokens
    metadata = _metadata(params, vocab, device)
    thresholds = _kernels().filter_thresholds_triton(logits, metadata)
    scaled = ops.apply_temperature(logits, metadata.gathered().temperature)
    kept = scaled >= thresholds.unsqueeze(1)
    reference = torch.isfinite(_torch_filtered(logits, metadata))
    for row, row_params in enumerate(params):
        assert torch.equal(kept[row] & torch.isfinite(scaled[row]), reference[row]), row_params


def check_ties_at_the_boundary(device):
    vocab = 600
    logits = _logits(4, vocab, device, seed=4).round()  # integer logits: many ties
    params = [SamplingParams(top_k=30), SamplingParams(top_k=3, min_p=0.1),
              SamplingParams(top_p=0.5), SamplingParams(top_p=0.9, top_k=50)]
    metadata = _metadata(params, vocab, device)
    thresholds = _kernels().filter_thresholds_triton(logits, metadata)
    scaled = ops.apply_temperature(logits, metadata.gathered().temperature)
    kept = scaled >= thresholds.unsqueeze(1)
    reference = torch.isfinite(_torch_filtered(logits, metadata))
    # top-k keeps every token tied with the k-th largest, as the torch op does.
    assert torch.equal(kept[:2], reference[:2])
    # top-p: the sort splits a tie group arbitrarily; the kernel keeps all of the group.
    for row in (2, 3):
        extra = kept[row] & ~reference[row]
        assert not (reference[row] & ~kept[row]).any()
        if extra.any():
            assert torch.all(scaled[row][extra] == thresholds[row])


def check_greedy_rows_take_the_first_maximum(device):
    vocab = 3000
    logits = _logits(6, vocab, device, seed=6)
    # Tied maxima in the same lane (50, 1074), another lane and block (2100): the first wins.
    logits[:, 2100] = logits[:, 1074] = logits[:, 50] = 20.0
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0.9)] * 2
    tokens = _kernels().choose_tokens_triton(logits, _metadata(params, vocab, device)).cpu()
    assert tokens[[0, 1, 3, 4]].tolist() == [50] * 4
    assert tokens[2].item() in (50, 1074, 2100) and tokens[5].item() in (50, 1074, 2100)


def check_small_batches_split_the_vocabulary(device):
    # One or two rows spread each row over several programs; the splits must agree with torch.
    vocab = 3000
    for num_rows in (1, 2):
        params = [SamplingParams(temperature=1.0, top_p=0.97), SamplingParams(temperature=0)][:num_rows]
        for salt in range(4):
            logits = _logits(num_rows, vocab, device, scale=0.5, seed=salt)
            _assert_same_samples(logits, _metadata(params, vocab, device, salt))


def check_peaked_rows_skip_hopeless_blocks(device):
    # Spikes in blocks 0 and 3 (of 1024 tokens): the kernel skips the noise of the blocks whose
    # best value plus the largest noise cannot reach the running best; samples must not change.
    vocab = 5000
    logits = _logits(16, vocab, device, scale=2.0, seed=10)
    logits[:, 100], logits[:, 3100], logits[:, 3900] = 38.0, 39.0, 39.5
    logits[8:, 4500] = 45.0  # and rows where the last block holds the clear winner
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3)] * 8
    _assert_same_samples(logits, _metadata(params, vocab, device, salt=3))


def check_banned_tokens_are_never_sampled(device):
    vocab = 1100
    logits = _logits(40, vocab, device, seed=8)
    logits[:, 7] = 30.0  # by far the most likely token
    params = [SamplingParams(min_tokens=1, stop_token_ids=[7], top_p=0.9)] * 20
    params += [SamplingParams(min_tokens=1, stop_token_ids=[7], temperature=0)] * 20
    sampler, idx_mapping, rows = _shuffled_sampler(params, list(range(40)), vocab, device,
                                                   output_token_ids=[[]] * 40)
    metadata = sampler.batch_metadata(idx_mapping, rows, torch.arange(40, device=device), min_tokens=range(40))
    constrained = sampler.apply_constraints(logits, metadata)
    tokens = _kernels().choose_tokens_triton(constrained, metadata)
    assert 7 not in tokens.tolist()
    assert torch.equal(tokens.cpu(), _torch_tokens(constrained, metadata).cpu())


def check_penalties_match_torch(device):
    vocab = 1500
    penalties = [(1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, -0.7), (0.8, 0.2, 0.4), (1.0, 0.0, 0.0)]
    params = [SamplingParams(temperature=0.7, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in penalties] * 3
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 50))] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 80))] for _ in params]  # repeats too
    logits = _logits(len(params), vocab, device, seed=11)
    logits[::4, :5] = float("-inf")  # banned tokens
    metadata = _metadata(params, vocab, device, prompt_token_ids=prompts, output_token_ids=outputs)
    assert not metadata.no_penalties
    without_prompts = dataclasses.replace(metadata, prompt_token_mask=None)
    for dtype in (torch.float32, torch.bfloat16):
        for case in (metadata, without_prompts):
            ours = _penalty_kernels().apply_penalties_triton(logits.to(dtype), case)
            batch = case.gathered()
            reference = ops.apply_penalties(logits.to(dtype).float(), batch.prompt_token_mask,
                                            batch.output_token_counts, batch.repetition_penalty,
                                            batch.frequency_penalty, batch.presence_penalty)
            assert ours.dtype == torch.float32
            assert torch.equal(ours.cpu(), reference.cpu()), (dtype, case.prompt_token_mask is None)


CHECKS = [
    check_mixed_batch_matches_torch,
    check_noise_matches_the_torch_hash,
    check_filter_sets_equal_the_torch_masks,
    check_ties_at_the_boundary,
    check_greedy_rows_take_the_first_maximum,
    check_small_batches_split_the_vocabulary,
    check_peaked_rows_skip_hopeless_blocks,
    check_banned_tokens_are_never_sampled,
    check_penalties_match_torch,
]

test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_sampler_triton", CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampler_dispatches_to_triton_without_syncs():
    vocab = 151936
    params = [KINDS[row % len(KINDS)] for row in range(256)]
    logits = _logits(len(params), vocab, "cuda", scale=4.0, seed=9)
    seeds = list(range(len(params)))
    sampler, idx_mapping, rows = _shuffled_sampler(params, seeds, vocab, "cuda", salt=9)
    positions = torch.arange(len(params), dtype=torch.int32, device="cuda")  # int32, as the runner's
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit synchronisation raises
    try:
        sampled = sampler.sample(logits, idx_mapping, rows, positions).sampled_token_ids
    finally:
        torch.cuda.set_sync_debug_mode(0)
    metadata = sampler.batch_metadata(idx_mapping, rows, positions)
    assert torch.equal(sampled, _kernels().choose_tokens_triton(logits, metadata))
    assert os.environ.get("WEIR_DISABLE_TRITON") != "1"
    _assert_same_samples(logits, metadata)
