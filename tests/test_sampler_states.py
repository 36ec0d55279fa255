"""The sampler's per-row state: rows written at admission, re-used, and read through idx_mapping."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from weir.sample import Sampler, as_int64_seed
from weir.sampling_params import SamplingParams

VOCAB = 48


def random_logits(num_rows, seed=0):
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def sample_rows(sampler, logits, rows, positions, min_tokens=()):
    """Sample batch row i with sampler row rows[i], as the runner calls the sampler."""
    rows = np.asarray(rows, dtype=np.int64)
    return sampler.sample(logits, torch.from_numpy(rows), rows, torch.tensor(positions, dtype=torch.int32),
                          min_tokens).sampled_token_ids


def alone(params, seed, logits_row, position, prompt=(), output=(), stop=(), banned=False):
    """What ``params`` sample on one row of a fresh sampler: the reference of every test here."""
    sampler = Sampler(1, VOCAB, "cpu", pin_memory=False)
    sampler.add_request(0, params, seed, list(prompt), list(output), list(stop))
    sampler.apply_staged_writes()
    return sample_rows(sampler, logits_row[None], [0], [position], [0] if banned else []).item()


def test_a_re_added_row_samples_with_its_new_parameters():
    sampler = Sampler(4, VOCAB, "cpu", pin_memory=False)
    greedy = SamplingParams(temperature=0, logprobs=2)
    sampler.add_request(2, greedy, 1, [1, 2], [], [5])
    sampler.add_request(0, SamplingParams(temperature=0.9), 7, [3], [], [])
    sampler.apply_staged_writes()
    logits = random_logits(2)
    logits[0, 5] = 50.0  # row 2's stop token, banned while it is short of min_tokens
    first = sampler.sample(logits, torch.tensor([2, 0]), np.array([2, 0]), torch.tensor([4, 4]), [0])
    assert first.logprobs.shape == (2, 3)
    unbanned = logits[0].clone()
    unbanned[5] = float("-inf")
    assert first.sampled_token_ids[0].item() == unbanned.argmax().item()

    sampler.remove_request(2)
    fresh = SamplingParams(temperature=1.0, top_k=3)
    sampler.add_request(2, fresh, 99, [], [], [])
    sampler.apply_staged_writes()
    metadata = sampler.batch_metadata(torch.tensor([2, 0]), np.array([2, 0]), torch.tensor([4, 4]), [0])
    assert metadata.max_num_logprobs is None and metadata.all_random and not metadata.no_top_k
    assert metadata.banned_token_ids is None  # the new request has no stop tokens
    logits = random_logits(2, seed=1)  # no spike: the new request samples among its top 3
    samples = []
    for position in range(40):
        token = sample_rows(sampler, logits, [2, 0], [position, position], [0])[0].item()
        assert token == alone(fresh, 99, logits[0], position)
        samples.append(token)
    # Sampled (not greedy as the row's old request), and never beyond the new top 3.
    assert len(set(samples)) > 1 and set(samples) <= set(logits[0].topk(3).indices.tolist())


def test_a_permuted_batch_samples_each_row_with_its_own_parameters_and_seed():
    kinds = [
        (SamplingParams(temperature=0), 11),
        (SamplingParams(temperature=1.2, top_k=5), 2**40 + 3),
        (SamplingParams(top_p=0.7), -17),
        (SamplingParams(temperature=0.8, min_p=0.2), 5),
        (SamplingParams(temperature=0.9, repetition_penalty=1.5, presence_penalty=0.5), 123),
        (SamplingParams(temperature=1.0), 2**63 + 5),  # wrapped into int64
    ]
    prompts, outputs = [[1, 2], [3], [], [4, 4], [6, 7, 8], [9]], [[], [2], [], [5], [7, 7], []]
    rows = [6, 1, 4, 0, 3, 5]  # sampler row of kind i; rows 2 and 7 stay empty
    sampler = Sampler(8, VOCAB, "cpu", pin_memory=False)
    for row, (params, seed), prompt, output in zip(rows, kinds, prompts, outputs):
        sampler.add_request(row, params, seed, prompt, output, [])
    sampler.apply_staged_writes()
    assert sampler.states.seeds.gpu[5].item() == as_int64_seed(2**63 + 5) == 5 - 2**63
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 4, 2], [4, 2], [2, 4, 0]):
        for position in (0, 3, 17):
            logits = random_logits(len(order), seed=position)
            tokens = sample_rows(sampler, logits, [rows[i] for i in order], [position] * len(order)).tolist()
            expected = [alone(kinds[i][0], kinds[i][1], logits[b], position, prompts[i], outputs[i])
                        for b, i in enumerate(order)]
            assert tokens == expected, (order, position)


def test_a_different_seed_at_a_row_changes_its_samples():
    """The permutation test above could pass if rows ignored their seeds: they must not."""
    sampler = Sampler(2, VOCAB, "cpu", pin_memory=False)
    sampler.add_request(0, SamplingParams(), 1, [], [], [])
    sampler.add_request(1, SamplingParams(), 2, [], [], [])
    sampler.apply_staged_writes()
    flat = torch.zeros(2, VOCAB)
    draws = [tuple(sample_rows(sampler, flat, [0, 1], [p, p]).tolist()) for p in range(20)]
    assert sum(a != b for a, b in draws) > 10


def test_the_penalty_state_of_a_re_used_row_starts_clean():
    penalised = SamplingParams(temperature=0, frequency_penalty=1.0, repetition_penalty=2.0)
    sampler = Sampler(3, VOCAB, "cpu", pin_memory=False)
    assert sampler.output_token_counts is None  # nothing allocated before a request uses penalties
    sampler.add_request(1, penalised, 0, [3, 4], [5, 5], [])
    sampler.add_request(0, penalised, 0, [7], [8], [])
    sampler.apply_staged_writes()
    counts, mask = sampler.output_token_counts, sampler.states.prompt_token_mask
    assert counts.shape == (3, VOCAB) and counts[1, 5].item() == 2 and mask[1, [3, 4]].all()
    counts[1, 9] += 4  # what the runner's post-update adds as row 1 samples

    sampler.remove_request(1)
    sampler.add_request(1, SamplingParams(temperature=0), 0, [10], [11], [])  # no penalties: state left
    sampler.apply_staged_writes()
    sampler.remove_request(1)
    sampler.add_request(1, penalised, 0, [20], [21, 21, 22], [])
    sampler.apply_staged_writes()
    expected_counts = torch.zeros(VOCAB, dtype=torch.int32)
    expected_counts[21], expected_counts[22] = 2, 1
    assert torch.equal(counts[1], expected_counts)
    assert mask[1].nonzero().flatten().tolist() == [20]
    assert counts[0].nonzero().flatten().tolist() == [8] and mask[0].nonzero().flatten().tolist() == [7]

    logits = torch.zeros(1, VOCAB)
    logits[0, 9], logits[0, 21], logits[0, 30] = 3.0, 3.0, 2.9
    # The old request's count of 9 is gone; the new one's two 21s are penalised: 9 wins.
    assert sample_rows(sampler, logits, [1], [0]).tolist() == [9]


def test_bad_rows_and_orders_are_refused():
    sampler = Sampler(2, VOCAB, "cpu", pin_memory=False)
    with pytest.raises(ValueError, match=r"row 2 is outside \[0, 2\)"):
        sampler.add_request(2, SamplingParams(), 0, [], [], [])
    sampler.add_request(0, SamplingParams(), 0, [], [], [])
    with pytest.raises(ValueError, match="already holds a request"):
        sampler.add_request(0, SamplingParams(), 0, [], [], [])
    sampler.remove_request(0)
    with pytest.raises(ValueError, match="apply first"):
        sampler.add_request(0, SamplingParams(), 0, [], [], [])
    with pytest.raises(ValueError, match=r"stop token ids must lie in \[0, 48\)"):
        sampler.add_request(1, SamplingParams(), 0, [], [], [VOCAB])
    with pytest.raises(ValueError, match=r"prompt token ids must lie in \[0, 48\)"):
        sampler.add_request(1, SamplingParams(presence_penalty=1.0), 0, [-1], [], [])
    sampler.apply_staged_writes()
    logits = torch.zeros(1, VOCAB)
    with pytest.raises(ValueError, match=r"sampler rows \[0\] hold no request"):
        sample_rows(sampler, logits, [0], [0])
    sampler.add_request(0, SamplingParams(), 0, [], [], [])
    sampler.apply_staged_writes()
    with pytest.raises(ValueError, match="one entry per batch row"):
        sampler.sample(logits, torch.tensor([0, 0]), np.array([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"min_tokens batch rows must lie in \[0, 1\)"):
        sample_rows(sampler, logits, [0], [0], [1])


def test_sampling_imports_no_runner_and_the_kernels_no_sampling():
    """The package layering: weir.sample and weir.buffers sit below the runner, weir.kernels below
    the sampler (every Triton module of each is imported, as a CUDA step would)."""
    code = (
        "import sys\n"
        "import weir.kernels.dispatch as d, weir.kernels.kv_store, weir.kernels.triton_input_prep\n"
        "import weir.kernels.triton_kv_store, weir.kernels.triton_layers, weir.kernels.triton_gemv\n"
        "import weir.kernels.triton_gated\n"
        "assert not [m for m in sys.modules if m.startswith('weir.sample')], 'kernels imported weir.sample'\n"
        "import weir.buffers, weir.sample\n"
        "for name in ('triton_sampler', 'triton_sample_filters', 'triton_penalties'):\n"
        "    d.triton_module('weir.sample.' + name)\n"
        "runner = [m for m in sys.modules if m.startswith('weir.runner')]\n"
        "assert not runner, runner\n"
        "print('layered')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "layered", result.stderr[-3000:]
