"""The torch reference sampler: greedy, seeded Gumbel-max, filters, penalties, bans, logprobs."""

import math

import numpy as np
import pytest
import torch

from weir.sample import Sampler
from weir.sample import ops
from weir.sampling_params import SamplingParams

VOCAB = 64


def all_rows(num_rows, device="cpu"):
    """(idx_mapping, rows) of a batch holding sampler rows 0 .. num_rows - 1 in order."""
    return torch.arange(num_rows, device=device), np.arange(num_rows)


def sample(logits, params, seeds=None, positions=None, output_token_ids=None, **kwargs):
    """Sample ``logits`` with row i holding ``params[i]``, through the runner's path."""
    num_rows = logits.shape[0]
    seeds = seeds if seeds is not None else list(range(num_rows))
    positions = positions if positions is not None else [0] * num_rows
    outputs = output_token_ids if output_token_ids is not None else [[] for _ in range(num_rows)]
    sampler = Sampler.for_params(params, seeds, logits.shape[1], device=logits.device, output_token_ids=outputs,
                                 **kwargs)
    # As the scheduler decides: rows short of min_tokens have their stop tokens banned.
    min_tokens = [row for row, (p, out) in enumerate(zip(params, outputs)) if len(out) < p.min_tokens]
    return sampler.sample(logits, *all_rows(num_rows, logits.device), torch.tensor(positions, device=logits.device),
                          min_tokens)


def random_logits(num_rows, vocab=VOCAB, seed=0):
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_input_untouched():
    logits = random_logits(8)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy_even_with_ties_in_a_mixed_batch():
    logits = random_logits(6)
    logits[:, 10] = logits[:, 20] = logits.max() + 1  # a tie at the maximum: argmax takes 10
    params = [SamplingParams(temperature=1.0, top_k=1)] * 5 + [SamplingParams(temperature=1.0)]
    for position in range(20):
        out = sample(logits, params, positions=[position] * 6)
        assert out.sampled_token_ids[:5].tolist() == [10] * 5
    # Same result when the metadata says every row is random (no torch.where path).
    sampler = Sampler.for_params([SamplingParams(temperature=2.0)] * 6, list(range(6)), VOCAB)
    metadata = sampler.batch_metadata(*all_rows(6), torch.zeros(6, dtype=torch.int64))
    metadata.top_k = torch.ones_like(metadata.top_k)
    metadata.no_top_k = False
    untied = random_logits(6, seed=3)
    assert torch.equal(sampler.sample_batch(untied, metadata).sampled_token_ids, untied.argmax(dim=-1))


def test_temperature_zero_ignores_filters():
    logits = random_logits(4)
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9)] * 4
    assert torch.equal(sample(logits, params).sampled_token_ids, logits.argmax(dim=-1))


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    target_logits = random_logits(1, seed=7)[0]
    target = SamplingParams(temperature=0.9, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5),
    ]
    for position in range(30):
        results = set()
        for row_order in ([], [0], [1, 3], [3, 2, 1, 0], [2, 0]):
            for insert_at in range(len(row_order) + 1):
                rows = [others[i] for i in row_order]
                rows.insert(insert_at, target)
                logits = random_logits(len(rows), seed=position)
                logits[insert_at] = target_logits
                seeds = [99 + i for i in range(len(rows))]
                seeds[insert_at] = 1234
                outputs = [[] for _ in rows]
                out = sample(logits, rows, seeds, [position] * len(rows), output_token_ids=outputs,
                             prompt_token_ids=[[1, 2, 3]] * len(rows))
                results.add(out.sampled_token_ids[insert_at].item())
        assert len(results) == 1, f"position {position}: {results}"


def test_different_seeds_and_positions_give_different_samples():
    flat = torch.zeros(40, VOCAB)
    params = [SamplingParams()] * 40
    by_seed = sample(flat, params, seeds=list(range(40)), positions=[5] * 40).sampled_token_ids
    by_position = sample(flat, params, seeds=[5] * 40, positions=list(range(40))).sampled_token_ids
    assert len(set(by_seed.tolist())) > 20
    assert len(set(by_position.tolist())) > 20
    again = sample(flat, params, seeds=list(range(40)), positions=[5] * 40).sampled_token_ids
    assert torch.equal(by_seed, again)


def _chi_square(samples, expected_probs):
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item(), int(keep.sum()) - 1


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), lambda l: l.softmax(-1)),
        (SamplingParams(temperature=0.5), lambda l: (l / 0.5).softmax(-1)),
        (SamplingParams(top_k=3), lambda l: torch.where(l >= l.topk(3).values[-1], l, -math.inf).softmax(-1)),
    ],
)
def test_empirical_distribution_matches_softmax(params, expected):
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    num_samples = 20000
    logits = base.expand(num_samples, -1).contiguous()
    # Many different seeds and positions: each (seed, position) pair is one independent draw.
    seeds = [i % 7 for i in range(num_samples)]
    positions = [i // 7 for i in range(num_samples)]
    samples = sample(logits, [params] * num_samples, seeds, positions).sampled_token_ids
    statistic, degrees = _chi_square(samples, expected(base))
    assert statistic < degrees + 5 * math.sqrt(2 * degrees), (statistic, degrees)


def test_top_k_top_p_min_p_mask_what_they_should():
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]] * 3)
    logits = probs.log()
    kept = lambda out: torch.isfinite(out).tolist()
    assert kept(ops.apply_top_k_top_p(logits[:1], torch.tensor([2]), None)) == [[True, True, False, False]]
    assert kept(ops.apply_top_k_top_p(logits[:1], None, torch.tensor([0.7]))) == [[True, True, False, False]]
    assert kept(ops.apply_top_k_top_p(logits[:1], None, torch.tensor([0.3]))) == [[True, False, False, False]]
    assert kept(ops.apply_top_k_top_p(logits[:1], None, torch.tensor([0.95]))) == [[True, True, True, True]]
    both = ops.apply_top_k_top_p(logits, torch.tensor([3, 0, 1]), torch.tensor([1.0, 0.8, 1.0]))
    assert kept(both) == [[True, True, True, False], [True, True, True, False], [True, False, False, False]]
    assert torch.equal(both[0, :3], logits[0, :3])  # survivors keep their logits
    min_p = ops.apply_min_p(logits, torch.tensor([0.0, 0.4, 0.25]))
    assert kept(min_p) == [[True] * 4, [True, True, False, False], [True, True, True, False]]


def test_filters_hold_in_the_sampler_over_many_draws():
    base = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -2.5])
    logits = base.expand(3000, -1).contiguous()
    for params, allowed in [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(min_p=0.5), {0, 1}),
    ]:
        samples = sample(logits, [params] * 3000, positions=list(range(3000))).sampled_token_ids
        assert set(samples.tolist()) == allowed, params


def test_penalties_follow_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    prompt_mask = torch.tensor([[1, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    counts = torch.tensor([[0, 2, 0, 1, 0], [3, 0, 0, 0, 0]], dtype=torch.int32)
    repetition, frequency, presence = [1.5, 1.0], [0.25, 0.5], [0.5, -1.0]
    result = ops.apply_penalties(logits, prompt_mask, counts, torch.tensor(repetition),
                                 torch.tensor(frequency), torch.tensor(presence))
    for row in range(2):
        for token in range(5):
            value = logits[row, token].item()
            count = counts[row, token].item()
            if prompt_mask[row, token] or count > 0:
                value = value / repetition[row] if value > 0 else value * repetition[row]
            value -= frequency[row] * count + presence[row] * (count > 0)
            assert result[row, token].item() == pytest.approx(value, abs=1e-6), (row, token)


def test_penalty_state_counts_outputs_and_marks_prompts_per_row():
    params = [SamplingParams(temperature=0.5, frequency_penalty=0.1)] * 3
    sampler = Sampler.for_params(params, [0, 1, 2], 5, output_token_ids=[[1, 1, 4], [], [0]],
                                 prompt_token_ids=[[2, 2], [3], []])
    metadata = sampler.batch_metadata(*all_rows(3), torch.zeros(3, dtype=torch.int64))
    assert metadata.output_token_counts is sampler.output_token_counts
    assert sampler.output_token_counts.tolist() == [[0, 2, 0, 0, 1], [0] * 5, [1, 0, 0, 0, 0]]
    assert metadata.prompt_token_mask.tolist() == [[False, False, True, False, False],
                                                   [False, False, False, True, False], [False] * 5]
    with pytest.raises(ValueError, match=r"output token ids must lie in \[0, 5\)"):
        Sampler.for_params(params[:1], [0], 5, output_token_ids=[[5]], prompt_token_ids=[[]])


def test_penalties_change_what_the_sampler_picks():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    out = sample(logits, params, output_token_ids=[[0]], prompt_token_ids=[[2]])
    assert out.sampled_token_ids.tolist() == [1]  # 5.0 / 2 < 4.9
    params = [SamplingParams(temperature=0, frequency_penalty=0.05)]
    assert sample(logits, params, output_token_ids=[[0, 0, 0]]).sampled_token_ids.tolist() == [1]
    assert sample(logits, params, output_token_ids=[[0]]).sampled_token_ids.tolist() == [0]


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(500, 8)
    logits[:, 3] = 5.0  # by far the most likely token
    params = [SamplingParams(min_tokens=2, stop_token_ids=[3])] * 250
    params += [SamplingParams(temperature=0, min_tokens=5)] * 250
    out = sample(logits, params, positions=list(range(500)), eos_token_ids=[3, 4],
                 output_token_ids=[[1]] * 500)
    assert 3 not in out.sampled_token_ids.tolist()
    assert 4 not in out.sampled_token_ids.tolist()
    # Once min_tokens are out, nothing is banned and greedy picks token 3 again.
    out = sample(logits[:1], [SamplingParams(temperature=0, min_tokens=1)], eos_token_ids=[3],
                 output_token_ids=[[1]])
    assert out.sampled_token_ids.tolist() == [3]


def test_min_tokens_bans_respect_ignore_eos():
    params = [SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True), SamplingParams(min_tokens=1)]
    sampler = Sampler.for_params(params, [0, 1], 16, eos_token_ids=[2])
    metadata = sampler.batch_metadata(*all_rows(2), torch.zeros(2, dtype=torch.int64), min_tokens=[0, 1])
    rows, tokens = metadata.banned_token_ids
    assert sorted(zip(rows.tolist(), tokens.tolist())) == [(0, 7), (1, 2)]


def test_logprobs_come_from_raw_logits():
    logits = random_logits(5)
    params = [SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.5, presence_penalty=1.0)] * 4
    params.append(SamplingParams(logprobs=0, temperature=0))
    out = sample(logits, params, output_token_ids=[[1, 2]] * 5, positions=[3] * 5)
    raw = logits.log_softmax(dim=-1)
    assert out.logprob_token_ids.shape == (5, 4) and out.logprobs.shape == (5, 4)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    expected_ranks = (raw > raw.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_token_ranks, expected_ranks)
    assert out.sampled_token_ranks[4].item() == 1  # the greedy row took the most likely token
    only_sampled = sample(logits, [SamplingParams(logprobs=0)] * 5)
    assert only_sampled.logprobs.shape == (5, 1)


def test_logprobs_of_bf16_logits_are_fp32_whatever_the_batch():
    """An all-greedy batch skipped the upcast, so a row's logprobs changed with its batch-mates."""
    logits = random_logits(2).bfloat16()
    greedy = SamplingParams(temperature=0, logprobs=3)
    alone = sample(logits[:1], [greedy])
    mixed = sample(logits, [greedy, SamplingParams(temperature=1.0)])
    assert alone.logprobs.dtype == torch.float32
    assert torch.equal(alone.logprobs[0], mixed.logprobs[0])
    assert torch.equal(alone.logprob_token_ids[0], mixed.logprob_token_ids[0])


def test_a_top_k_beyond_int32_is_clamped_to_the_vocabulary():
    sampler = Sampler.for_params([SamplingParams(top_k=2**40)], [0], VOCAB)
    metadata = sampler.batch_metadata(*all_rows(1), torch.zeros(1, dtype=torch.int64))
    assert metadata.gathered().top_k.tolist() == [VOCAB]


def test_uniform_noise_is_deterministic_and_strictly_inside_zero_one():
    seeds = torch.tensor([0, -1, 2**62, -(2**63), 12345])
    positions = torch.tensor([0, 1, 2, 3, 100000])
    uniform = ops.uniform_noise(seeds, positions, 50000)
    assert uniform.dtype == torch.float32 and uniform.shape == (5, 50000)
    assert (uniform > 0).all() and (uniform < 1).all()
    assert torch.equal(uniform, ops.uniform_noise(seeds, positions, 50000))
    assert abs(uniform.mean().item() - 0.5) < 0.01 and abs(uniform.var().item() - 1 / 12) < 0.005
    # A longer vocabulary extends the noise; it does not reshuffle it.
    assert torch.equal(uniform[:, :100], ops.uniform_noise(seeds, positions, 100))
    assert torch.isfinite(ops.gumbel_noise(seeds, positions, 50000)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampler_never_synchronises_and_matches_the_cpu():
    num_rows, vocab = 64, 4096
    kinds = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(top_k=20, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
    ]
    params = [kinds[row % 4] for row in range(num_rows)]
    logits = random_logits(num_rows, vocab)
    host_lists = dict(
        seeds=[row * 31 for row in range(num_rows)], vocab_size=vocab, output_token_ids=[[1, 2, 2]] * num_rows,
        prompt_token_ids=[[3, 4]] * num_rows, eos_token_ids=[0],
    )
    positions = torch.tensor([row + 7 for row in range(num_rows)], dtype=torch.int32)
    min_tokens = [row for row in range(num_rows) if params[row].min_tokens > 3]  # 3 outputs so far
    cpu_out = Sampler.for_params(params, device="cpu", **host_lists).sample(
        logits, *all_rows(num_rows), positions, min_tokens)
    cuda_sampler = Sampler.for_params(params, device="cuda", **host_lists)
    cuda_logits, cuda_positions = logits.cuda(), positions.cuda()
    idx_mapping, rows = all_rows(num_rows, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit synchronisation raises
    try:
        cuda_out = cuda_sampler.sample(cuda_logits, idx_mapping, rows, cuda_positions, min_tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(cuda_out.sampled_token_ids.cpu(), cpu_out.sampled_token_ids)
    assert torch.allclose(cuda_out.logprobs.cpu(), cpu_out.logprobs, atol=1e-5)
