"""The n-gram proposal kernel against its torch version (``propose_ngram`` + ``write_drafts``):
the whole token table and every row's draft count equal after a step's proposals.

Each comparison runs interpreted on CPU tensors and compiled on a CUDA device (marked ``gpu``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers_triton import kernels_fixture
from weir.kernels.dispatch import triton_importable
from weir.spec_decode.ngram import propose_ngram, write_drafts

pytestmark = pytest.mark.skipif(not triton_importable(), reason="Triton is not installed")
kernels = kernels_fixture("triton_ngram")


def repetitive_table(seed: int, num_rows: int, max_model_len: int, vocab: int):
    """Token rows drawn from a small vocabulary with copied spans, so that suffixes recur; row
    lengths cover the edges: empty, one token, shorter than the n-grams, full to max_model_len,
    and one past a host bound of max_model_len - 3."""
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, vocab, (num_rows, max_model_len), generator=gen, dtype=torch.int32)
    for row in range(num_rows):
        span = int(torch.randint(3, 9, (1,), generator=gen))
        source = int(torch.randint(0, max_model_len // 2, (1,), generator=gen))
        target = int(torch.randint(max_model_len // 2, max_model_len - span, (1,), generator=gen))
        token_ids[row, target:target + span] = token_ids[row, source:source + span].clone()
    num_tokens = torch.randint(2, max_model_len + 1, (num_rows,), generator=gen, dtype=torch.int32)
    num_tokens[:5] = torch.tensor([0, 1, 2, max_model_len, max_model_len - 1], dtype=torch.int32)
    return token_ids, num_tokens


def run_both(module, device, token_ids, num_tokens, rows, max_len, min_n, max_n, k):
    num_drafts = torch.full_like(num_tokens, -7)  # rows not proposed for keep it
    table = SimpleNamespace(token_ids=SimpleNamespace(gpu=token_ids.clone().to(device)),
                            num_tokens=SimpleNamespace(gpu=num_tokens.to(device)),
                            num_drafts=SimpleNamespace(gpu=num_drafts.clone().to(device)))
    rows = rows.to(device)
    drafts, counts = propose_ngram(table.token_ids.gpu, table.num_tokens.gpu, rows, max_len, min_n, max_n, k)
    write_drafts(table, rows, drafts, counts)
    got_tokens, got_drafts = token_ids.clone().to(device), num_drafts.clone().to(device)
    module.propose_ngram_triton(got_tokens, table.num_tokens.gpu, got_drafts, rows, max_len, min_n, max_n, k)
    return (got_tokens, got_drafts), (table.token_ids.gpu, table.num_drafts.gpu)


@pytest.mark.parametrize("min_n,max_n,k", [(2, 4, 4), (1, 1, 2), (1, 5, 7), (3, 3, 1)])
def test_ngram_kernel_matches_torch(kernels, min_n, max_n, k):
    module, device = kernels
    num_rows, max_model_len = 40, 96
    token_ids, num_tokens = repetitive_table(k * 10 + max_n, num_rows, max_model_len, vocab=6)
    gen = torch.Generator().manual_seed(max_n)
    rows = torch.randperm(num_rows, generator=gen)[:33]
    rows = torch.cat([torch.arange(5), rows[rows >= 5]])  # the edge rows always among them
    max_len = max_model_len - 3  # the host's bound may be short of a row's length: both clamp to it
    (got_tokens, got_drafts), (want_tokens, want_drafts) = run_both(
        module, device, token_ids, num_tokens, rows, max_len, min_n, max_n, k)
    assert torch.equal(got_drafts, want_drafts)
    assert torch.equal(got_tokens, want_tokens)
    proposed = want_drafts[rows.to(device)]
    assert (proposed > 0).sum() >= 2 and (proposed == 0).sum() >= 2  # rows with drafts and rows without
    assert int(want_drafts[3]) == 0  # a full row has no room for drafts


def test_ngram_kernel_windows_past_one_block(kernels):
    """Rows longer than the kernel's window block: the latest full match sits in the last block,
    an earlier one in the first; the kernel must pick the latest, as the torch version does."""
    module, device = kernels
    max_model_len = 2600
    gen = torch.Generator().manual_seed(3)
    token_ids = torch.randint(10, 1000, (2, max_model_len), generator=gen, dtype=torch.int32)
    pattern = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9], dtype=torch.int32)
    length = 2500
    for row, (first, second) in enumerate([(40, 2300), (40, 1500)]):
        token_ids[row, first:first + 9] = pattern
        token_ids[row, second:second + 9] = pattern + 100 * (row + 1)
        token_ids[row, second:second + 3] = pattern[:3]
        token_ids[row, length - 3:length] = pattern[:3]  # the suffix: 1 2 3
    num_tokens = torch.tensor([length, length], dtype=torch.int32)
    (got_tokens, got_drafts), (want_tokens, want_drafts) = run_both(
        module, device, token_ids, num_tokens, torch.arange(2), max_model_len, 2, 3, 4)
    assert torch.equal(got_drafts, want_drafts) and torch.equal(got_tokens, want_tokens)
    assert want_tokens[0, length:length + 4].tolist() == (pattern[3:7] + 100).tolist()  # the latest match
    assert int(want_drafts[0]) == 4


def test_no_rows_is_a_no_op(kernels):
    module, device = kernels
    token_ids = torch.zeros(2, 8, dtype=torch.int32, device=device)
    num_drafts = torch.zeros(2, dtype=torch.int32, device=device)
    module.propose_ngram_triton(token_ids, num_drafts.clone(), num_drafts, torch.zeros(0, dtype=torch.int64,
                                                                                     device=device), 8, 1, 2, 2)
    assert not token_ids.any() and not num_drafts.any()
