"""Input-preparation Triton kernels against their torch versions (and the torch versions
against plain per-request loops).

Each comparison runs twice: interpreted on CPU tensors (``interpreted_module`` loads a private
copy of the kernels under ``TRITON_INTERPRET=1``, whatever else this process imported), and
compiled on a CUDA device (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from helpers_triton import kernels_fixture
from weir.buffers.staged_write import scatter_flat_torch
from weir.kernels.dispatch import triton_importable
from weir.runner import inputs

pytestmark = pytest.mark.skipif(not triton_importable(), reason="Triton is not installed")
kernels = kernels_fixture("triton_input_prep")


def random_batch(seed, num_reqs, max_query_len, max_model_len, num_pad_reqs=0, num_pad_tokens=0,
                 pad_req_tokens=0, device="cpu"):
    """A request table and a batch over distinct rows, padded as a CUDA-graph batch would be.

    Edge cases are forced in: request 0 has no computed tokens, request 1's chunk ends
    exactly at max_model_len. Padding requests (idx -1) own ``pad_req_tokens`` tokens each.
    """
    gen = torch.Generator().manual_seed(seed)
    num_rows = num_reqs + num_pad_reqs + 3
    token_ids = torch.randint(0, 50_000, (num_rows, max_model_len), generator=gen, dtype=torch.int32)
    num_computed = torch.randint(0, max_model_len, (num_rows,), generator=gen, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=gen)[:num_reqs]
    query_lens = []
    for i, row in enumerate(rows.tolist()):
        if i == 0:
            num_computed[row] = 0
        room = max_model_len - int(num_computed[row])
        query_len = int(torch.randint(1, min(max_query_len, room) + 1, (1,), generator=gen))
        if i == 1:
            query_len = min(max_query_len, max_model_len)
            num_computed[row] = max_model_len - query_len
        query_lens.append(query_len)
    idx_mapping = torch.cat([rows, torch.full((num_pad_reqs,), -1)])  # [B] int64
    query_lens += [pad_req_tokens] * num_pad_reqs
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    num_tokens = int(query_start_loc[-1]) + num_pad_tokens
    tensors = [token_ids, num_computed, idx_mapping, query_start_loc]
    return [t.to(device) for t in tensors] + [num_tokens]


def prepare_loop_reference(token_ids, num_computed, idx_mapping, query_start_loc, num_tokens):
    input_ids, positions = [0] * num_tokens, [0] * num_tokens
    seq_lens = []
    for req, row in enumerate(idx_mapping.tolist()):
        start, end = int(query_start_loc[req]), int(query_start_loc[req + 1])
        seq_lens.append(0 if row < 0 else int(num_computed[row]) + end - start)
        for token in range(start, end):
            if row >= 0:
                positions[token] = int(num_computed[row]) + token - start
                input_ids[token] = int(token_ids[row, positions[token]])
    return torch.tensor(input_ids), torch.tensor(positions), torch.tensor(seq_lens, dtype=torch.int32)


SHAPES = [  # num_reqs, max_query_len, max_model_len, num_pad_reqs, num_pad_tokens, pad_req_tokens
    (1, 1, 16, 0, 0, 0),
    (6, 7, 64, 0, 0, 0),
    (3, 300, 640, 0, 0, 0),  # chunks longer than one kernel block
    (5, 1, 32, 3, 3, 0),  # padded decode: repeated query_start_loc and a tail of padding tokens
    (4, 5, 40, 2, 1, 2),  # padding requests that own tokens
]


@pytest.mark.parametrize("shape", SHAPES)
def test_prepare_step_inputs(kernels, shape):
    module, device = kernels
    *batch, num_tokens = random_batch(sum(shape), *shape, device=device)
    expected = inputs.prepare_step_inputs_torch(*batch, num_tokens)
    loop = prepare_loop_reference(*[t.cpu() for t in batch], num_tokens)
    for got, want, by_loop in zip(module.prepare_step_inputs_triton(*batch, num_tokens), expected, loop):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert torch.equal(want.cpu(), by_loop)
    query_start_loc = batch[3]
    static_qsl = torch.cat([query_start_loc, query_start_loc[-1:].repeat(3)])  # a longer static buffer
    for got, want in zip(module.prepare_step_inputs_triton(*batch[:3], static_qsl, num_tokens), expected):
        assert torch.equal(got, want)
    assert torch.equal(module.token_to_request_triton(query_start_loc, num_tokens),
                       inputs.token_to_request_torch(query_start_loc, num_tokens))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_tables_and_slot_mapping(kernels, shape, block_size):
    module, device = kernels
    token_ids, num_computed, idx_mapping, query_start_loc, num_tokens = random_batch(
        7 * sum(shape) + block_size, *shape, device=device)
    _, positions, _ = inputs.prepare_step_inputs_torch(token_ids, num_computed, idx_mapping, query_start_loc,
                                                       num_tokens)
    max_blocks = -(-token_ids.shape[1] // block_size)
    block_table = torch.randint(1, 10_000, (token_ids.shape[0], max_blocks), dtype=torch.int32, device=device)

    gathered = module.gather_block_tables_triton(block_table, idx_mapping)
    assert torch.equal(gathered, inputs.gather_block_tables_torch(block_table, idx_mapping))
    assert gathered.dtype == torch.int32 and gathered.shape == (idx_mapping.shape[0], max_blocks)
    slots = module.compute_slot_mapping_triton(gathered, query_start_loc, positions, block_size)
    assert torch.equal(slots, inputs.compute_slot_mapping_torch(gathered, query_start_loc, positions, block_size))
    # Every cache group's table in one launch: a second group with other blocks.
    block_tables = torch.stack([block_table, torch.randint(1, 10_000, block_table.shape, dtype=torch.int32,
                                                           device=device)])  # [G, R, max_blocks]
    fused = module.gather_block_tables_and_slot_mapping_triton(block_tables, idx_mapping, query_start_loc,
                                                               positions, block_size)
    want = inputs.gather_block_tables_and_slot_mapping_torch(block_tables, idx_mapping, query_start_loc,
                                                            positions, block_size)
    assert torch.equal(fused[0], want[0]) and torch.equal(fused[1], want[1])
    assert torch.equal(want[0][0], gathered)
    # Into persistent buffers wider than the batch (what the runner passes): the same values.
    out = (torch.full((2, idx_mapping.shape[0] + 3, max_blocks), -7, dtype=torch.int32, device=device),
           torch.full((2, positions.shape[0] + 5), -7, dtype=torch.int64, device=device))
    views = (out[0][:, : idx_mapping.shape[0]], out[1][:, : positions.shape[0]])
    module.gather_block_tables_and_slot_mapping_triton(block_tables, idx_mapping, query_start_loc, positions,
                                                       block_size, out=views)
    assert torch.equal(views[0], want[0]) and torch.equal(views[1], want[1])
    assert out[0][:, idx_mapping.shape[0]:].eq(-7).all() and out[1][:, positions.shape[0]:].eq(-7).all()
    # Token-by-token: the slot of every owned token, -1 for padding.
    owner = inputs.token_to_request_torch(query_start_loc, num_tokens).tolist()
    for group in range(2):
        for token, req in enumerate(owner):
            row = int(idx_mapping[req]) if req < idx_mapping.shape[0] else -1
            pos = int(positions[token])
            table = block_tables[group]
            slot = -1 if row < 0 else int(table[row, pos // block_size]) * block_size + pos % block_size
            assert int(want[1][group, token]) == slot


def test_slot_mapping_past_the_block_table(kernels):
    """Positions past a row's last block column (a draft pass beyond max_model_len) get slot -1,
    in both versions, and never an index error."""
    module, device = kernels
    block_size, max_blocks = 4, 3
    block_table = torch.arange(1, 1 + 2 * max_blocks, dtype=torch.int32, device=device).view(2, max_blocks)
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    positions = torch.tensor([10, 11, 12, 13, 20], dtype=torch.int64, device=device)
    want = torch.tensor([3 * 4 + 2, 3 * 4 + 3, -1, -1, -1], dtype=torch.int64)
    got = inputs.compute_slot_mapping_torch(block_table, query_start_loc, positions, block_size)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(module.compute_slot_mapping_triton(block_table, query_start_loc, positions, block_size).cpu(),
                       want)


def random_table_state(seed, num_rows, max_model_len, vocab_size, device):
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, vocab_size, (num_rows, max_model_len), generator=gen, dtype=torch.int32)
    num_tokens = torch.randint(1, max_model_len + 1, (num_rows,), generator=gen, dtype=torch.int32)
    num_tokens[0] = max_model_len  # row 0 is full: its sample is real but never stored
    computed = (torch.rand(num_rows, generator=gen) * num_tokens.float()).int()  # [0, known)
    counts = torch.randint(0, 3, (num_rows, vocab_size), generator=gen, dtype=torch.int32)
    return [t.to(device) for t in (token_ids, num_tokens, computed, counts)]


def post_update_loop_reference(token_ids, num_tokens, num_computed, counts, idx_mapping, query_lens, sampled):
    for row, query_len, token in zip(idx_mapping.tolist(), query_lens.tolist(), sampled.tolist()):
        if row < 0:
            continue
        num_computed[row] += query_len
        if num_computed[row] >= num_tokens[row]:
            if num_tokens[row] < token_ids.shape[1]:
                token_ids[row, num_tokens[row]] = token
            num_tokens[row] += 1
            if counts is not None:
                counts[row, token] += 1


@pytest.mark.parametrize("num_reqs,num_pad_reqs", [(1, 0), (7, 0), (150, 0), (5, 4)])
@pytest.mark.parametrize("with_counts", [True, False])
def test_post_update(kernels, num_reqs, num_pad_reqs, with_counts):
    module, device = kernels
    num_rows, max_model_len, vocab_size = num_reqs + 4, 12, 40
    state = random_table_state(num_reqs + num_pad_reqs, num_rows, max_model_len, vocab_size, device)
    gen = torch.Generator().manual_seed(num_reqs)
    rows = torch.cat([torch.tensor([0]), 1 + torch.randperm(num_rows - 1, generator=gen)[: num_reqs - 1]])
    idx_mapping = torch.cat([rows, torch.full((num_pad_reqs,), -1)]).to(device)  # [B]
    remaining = (state[1] - state[2]).cpu()[rows]  # tokens left to compute, >= 1
    # Half the requests finish their known tokens (a real sample), half stop short of them.
    query_lens = torch.where(torch.arange(num_reqs) % 2 == 0, remaining, (remaining - 1).clamp_min(1))
    query_lens = torch.cat([query_lens, torch.full((num_pad_reqs,), 3)]).int().to(device)
    sampled = torch.randint(0, vocab_size, (num_reqs + num_pad_reqs,), generator=gen).to(device)

    def run(update):
        token_ids, num_tokens, computed, counts = [t.clone() for t in state]
        counts = counts if with_counts else None
        update(token_ids, num_tokens, computed, counts, idx_mapping, query_lens, sampled)
        return token_ids, num_tokens, computed, counts

    expected = run(inputs.post_update_torch)
    for got, want, by_loop in zip(run(module.post_update_triton), expected, run(post_update_loop_reference)):
        if not with_counts and want is None:  # the counts slot
            assert got is None and by_loop is None
        else:
            assert torch.equal(got, want) and torch.equal(want, by_loop)
    assert int(expected[1][0]) == max_model_len + 1  # counted, yet nothing written past the end


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("num_writes", [1, 37, 2500])
def test_scatter_flat(kernels, dtype, num_writes):
    module, device = kernels
    gen = torch.Generator().manual_seed(num_writes)
    target = (torch.randn(60, 50, generator=gen) * 100).to(dtype).to(device)
    flat_index = torch.randperm(target.numel(), generator=gen)[:num_writes].to(device)
    values = (torch.randn(num_writes, generator=gen) * 100).to(dtype).to(device)
    got, want = target.clone(), target.clone()
    module.scatter_flat_triton(got, flat_index, values)
    scatter_flat_torch(want, flat_index, values)
    assert torch.equal(got, want)
    assert not torch.equal(want, target)



def test_positions_past_max_model_len_read_nothing(kernels):
    """A draft head's pass after a request's last slot (warm-up's decode at max_model_len, then
    its lookahead): tokens past the table read id 0 and get slot -1, in the torch versions as in
    the kernels (the torch ones indexed out of bounds: an IndexError, a device assert on CUDA
    with WEIR_DISABLE_TRITON=1)."""
    module, device = kernels
    max_model_len, block_size = 16, 4
    token_ids = torch.arange(2 * max_model_len, dtype=torch.int32, device=device).view(2, max_model_len) + 1
    num_computed = torch.tensor([14, 3], dtype=torch.int32, device=device)  # row 0: positions 14..17
    idx_mapping = torch.tensor([0, 1], device=device)
    query_start_loc = torch.tensor([0, 4, 5], dtype=torch.int32, device=device)
    batch = (token_ids, num_computed, idx_mapping, query_start_loc, 5)
    want_ids = torch.tensor([15, 16, 0, 0, 20], device=device)
    want_positions = torch.tensor([14, 15, 16, 17, 3], device=device)
    for input_ids, positions, _ in (inputs.prepare_step_inputs_torch(*batch),
                                    module.prepare_step_inputs_triton(*batch)):
        assert torch.equal(input_ids, want_ids) and torch.equal(positions, want_positions)
    block_tables = torch.tensor([[[5, 6, 7, 8], [9, 10, 11, 12]]], dtype=torch.int32, device=device)  # [G, R, blocks]
    want_slots = torch.tensor([[34, 35, -1, -1, 39]], device=device)
    for tables, slots in (
            inputs.gather_block_tables_and_slot_mapping_torch(block_tables, idx_mapping, query_start_loc,
                                                              want_positions, block_size),
            module.gather_block_tables_and_slot_mapping_triton(block_tables, idx_mapping, query_start_loc,
                                                               want_positions, block_size)):
        assert torch.equal(slots, want_slots) and torch.equal(tables, block_tables)
