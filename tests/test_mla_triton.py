"""The Triton MLA / DSA backend (``triton_mla``) against a dense torch oracle.

The oracle works request by request in float64 and in the *expanded* form: it rebuilds every
position's latent from the paged cache (the cached prefix) and from this step's inputs (the new
tokens), expands per-head keys ``[W_UK c ; k_pe]`` and values ``W_UV c``, and attends causally
(for sparse layers over the keys the backend's top-k picked, after checking that pick against
the oracle's own indexer scores). The backend computes the absorbed form, so agreement also
checks that the two forms agree.

Every case is poisoned: cache slots no request owns (spare blocks, slots past a request's
length, the slots this step is about to write) hold NaN, and unused block-table entries point
at a NaN block, so a kernel that reads anything it must not (or skips a store) returns NaN.
Block 0, the null block that padding requests point at, stays finite.

Tiny shapes run in Triton's interpreter on the CPU (fp32; ``CHECKS``); the same checks compile
on CUDA, and the ``gpu`` tests below add DeepSeek's real shapes in bf16, CUDA graphs and a
no-sync check.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest
import torch

from helpers_triton import kernel_check_tests
from weir.attention import AttentionMetadata
from weir.mla import IndexerInputs, MLALayerSpec

TINY = dict(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
TINY_INDEXER = dict(index_n_heads=4, index_head_dim=16, index_topk=8)
DEEPSEEK = dict(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
DEEPSEEK_INDEXER = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)


@dataclass
class MLACase:
    layer: MLALayerSpec
    q_nope: torch.Tensor  # [T + padding, H, nope]
    q_pe: torch.Tensor  # [T + padding, H, rope]
    kv_c: torch.Tensor  # [T + padding, lora]
    k_pe: torch.Tensor  # [T + padding, rope]
    kv_cache: torch.Tensor  # [num_blocks, block_size, cache_dim]; the state before this step's store
    metadata: AttentionMetadata
    w_uk: torch.Tensor  # [H, nope, lora]
    w_uv: torch.Tensor  # [H, v, lora]
    indexer: IndexerInputs | None = None
    padding_reqs: set[int] = field(default_factory=set)  # CUDA-graph style: no blocks, slot -1

    def args(self, kv_cache: torch.Tensor) -> tuple:
        return (self.layer, self.q_nope, self.q_pe, self.kv_c, self.k_pe, kv_cache, self.metadata, self.w_uk,
                self.w_uv)


def mla_layer(shape: dict, indexer: dict | None = None) -> MLALayerSpec:
    return MLALayerSpec(layer_idx=0, **shape, **(indexer or {}),
                        scale=(shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"]) ** -0.5)


def make_mla_case(query_lens, seq_lens, layer: MLALayerSpec, *, block_size: int, dtype: torch.dtype, device: str,
                  num_padding_tokens: int = 2, padding_reqs=(), seed: int = 0, num_blocks: int | None = None,
                  max_blocks_per_req: int | None = None, tie_every: int = 0) -> MLACase:
    """Request r holds seq_lens[r] - query_lens[r] cached tokens and gets query_lens[r] new ones;
    requests in ``padding_reqs`` are graph padding (query_len 1, a zero block-table row, slot -1,
    seq_len 0 or 1). ``tie_every`` k > 0: every k-th position of a request, cached or new, repeats
    one cache row, so their indexer scores tie (and the attention cannot tell which of them won)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    blocks_needed = [0 if req in padding_reqs else -(-seq_len // block_size) for req, seq_len in enumerate(seq_lens)]
    num_blocks = num_blocks or 2 + sum(blocks_needed) + 3
    max_blocks_per_req = max_blocks_per_req or max(blocks_needed) + 2
    block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # never the null block
    stale_block = block_ids.pop()  # never owned: the stale entry of every unused table slot
    block_tables = torch.full((len(seq_lens), max_blocks_per_req), stale_block, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, layer.cache_dim), float("nan"), dtype=torch.float64)
    cache[0] = 0.0  # the null block stays finite
    num_tokens = sum(query_lens)
    rows = num_tokens + num_padding_tokens
    step_rows = rand(rows, layer.cache_dim)  # this step's kv_c | k_pe | indexer k
    slots, token = [], 0
    for req, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if req in padding_reqs:
            block_tables[req] = 0
            slots.append(-1)
            token += query_len
            continue
        table = [block_ids.pop() for _ in range(blocks_needed[req])]
        block_tables[req, : len(table)] = torch.tensor(table, dtype=torch.int32)
        tied_row = rand(layer.cache_dim)
        for pos in range(seq_len):
            row = tied_row if tie_every and pos % tie_every == 0 else rand(layer.cache_dim)
            if pos < seq_len - query_len:  # the cached prefix
                cache[table[pos // block_size], pos % block_size] = row
            else:
                step_rows[token] = row
                slots.append(table[pos // block_size] * block_size + pos % block_size)
                token += 1
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    metadata = AttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots + [-1] * num_padding_tokens, dtype=torch.int64).to(device),
        num_reqs=len(query_lens), num_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    lora, heads = layer.kv_lora_rank, layer.num_heads

    def to(tensor):
        return tensor.to(dtype).to(device)

    # Unit-variance scores: normalised latents, weights scaled by 1/sqrt(lora). q_pe is a strided
    # view, as a fused projection gives it.
    q_pe = to(rand(rows, heads + 1, layer.qk_rope_head_dim))[:, :heads]
    case = MLACase(
        layer=layer, q_nope=to(rand(rows, heads, layer.qk_nope_head_dim)), q_pe=q_pe,
        kv_c=to(step_rows[:, :lora]), k_pe=to(step_rows[:, lora:layer.latent_dim]), kv_cache=to(cache),
        metadata=metadata, w_uk=to(rand(heads, layer.qk_nope_head_dim, lora, scale=lora ** -0.5)),
        w_uv=to(rand(heads, layer.v_head_dim, lora, scale=lora ** -0.5)), padding_reqs=set(padding_reqs))
    if layer.index_topk:
        case.indexer = IndexerInputs(q=to(rand(rows, layer.index_n_heads, layer.index_head_dim)),
                                     k=to(step_rows[:, layer.latent_dim:]),
                                     weights=rand(rows, layer.index_n_heads).float().to(device))
    return case


def request_rows(case: MLACase, req: int, column_from: int, column_to: int, step_rows: torch.Tensor) -> torch.Tensor:
    """Columns of request req's every position in float64 (on the case's device): cached ones
    from the cache through the block table, this step's from the step inputs ``step_rows``."""
    metadata, block_size = case.metadata, case.kv_cache.shape[1]
    begin, end = (int(x) for x in metadata.query_start_loc[req: req + 2])
    context = torch.arange(int(metadata.seq_lens[req]) - (end - begin), device=case.kv_cache.device)
    blocks = metadata.block_tables[req, context // block_size].long()
    cached = case.kv_cache[blocks, context % block_size, column_from:column_to]
    return torch.cat([cached, step_rows[begin:end]]).double()


def oracle_indexer_scores(case: MLACase, req: int) -> torch.Tensor:  # [query_len, seq_len] float64, -inf: future
    layer, indexer = case.layer, case.indexer
    begin, end = (int(x) for x in case.metadata.query_start_loc[req: req + 2])
    keys = request_rows(case, req, layer.latent_dim, layer.cache_dim, indexer.k)  # [S, D]
    logits = torch.einsum("qgd,sd->qgs", indexer.q[begin:end].double(), keys)
    scores = (logits.clamp_min(0) * indexer.weights[begin:end].double().unsqueeze(-1)).sum(1)
    return scores.masked_fill(~causal_mask(case, req), float("-inf")).cpu()


def causal_mask(case: MLACase, req: int) -> torch.Tensor:  # [query_len, seq_len]
    begin, end = (int(x) for x in case.metadata.query_start_loc[req: req + 2])
    seq_len = int(case.metadata.seq_lens[req])
    device = case.kv_cache.device
    query_pos = torch.arange(seq_len - (end - begin), seq_len, device=device).unsqueeze(1)
    return torch.arange(seq_len, device=device).unsqueeze(0) <= query_pos


def oracle_mla(case: MLACase, topk: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Expanded MLA per (non-padding) request: {req: [query_len, H, v] float64}; with ``topk``
    [T, K] each query sees only the listed keys."""
    layer = case.layer
    lora, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
    w_uk, w_uv = case.w_uk.double(), case.w_uv.double()
    outputs = {}
    for req in range(case.metadata.num_reqs):
        if req in case.padding_reqs:
            continue
        begin, end = (int(x) for x in case.metadata.query_start_loc[req: req + 2])
        latent = request_rows(case, req, 0, lora, case.kv_c)  # [S, lora]
        k_pe = request_rows(case, req, lora, lora + rope, case.k_pe)  # [S, rope]
        k_nope = torch.einsum("hdl,sl->shd", w_uk, latent)  # [S, H, nope]
        values = torch.einsum("hvl,sl->shv", w_uv, latent)  # [S, H, v]
        q_nope, q_pe = case.q_nope[begin:end].double(), case.q_pe[begin:end].double()
        scores = (torch.einsum("qhd,shd->hqs", q_nope, k_nope) + torch.einsum("qhr,sr->hqs", q_pe, k_pe)) * layer.scale
        visible = causal_mask(case, req)  # [Q, S]
        if topk is not None:
            chosen = torch.zeros_like(visible)
            for query, token in enumerate(range(begin, end)):
                listed = topk[token].long()
                chosen[query, listed[listed >= 0]] = True
            visible &= chosen
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outputs[req] = torch.einsum("hqs,shv->qhv", probs, values).cpu()
    return outputs


def check_topk(case: MLACase, topk: torch.Tensor) -> None:
    """Each token's list: min(index_topk, position + 1) distinct visible positions first, -1 after,
    and no unlisted key scoring above a listed one (ties may go either way)."""
    layer, metadata = case.layer, case.metadata
    assert topk.shape == (metadata.num_tokens, layer.index_topk) and topk.dtype == torch.int32
    for req in range(metadata.num_reqs):
        if req in case.padding_reqs:
            continue
        scores = oracle_indexer_scores(case, req)
        begin = int(metadata.query_start_loc[req])
        for query in range(scores.shape[0]):
            listed = topk[begin + query].cpu().long()
            visible = int(torch.isfinite(scores[query]).sum())
            count = min(layer.index_topk, visible)
            assert (listed[:count] >= 0).all() and (listed[count:] == -1).all(), listed
            chosen = listed[:count]
            assert len(set(chosen.tolist())) == count and int(chosen.max()) < visible, chosen
            if count < visible:
                row = scores[query, :visible]
                others = torch.ones(visible, dtype=torch.bool)
                others[chosen] = False
                tolerance = 1e-5 * float(row.abs().max()) + 1e-6
                assert float(row[chosen].min()) >= float(row[others].max()) - tolerance, (req, query)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1.5e-2}


def check_backend(backend, case: MLACase) -> torch.Tensor:
    """Run the backend on a copy of the cache; check the stored rows, the output against the
    oracle (per request, by relative error), padding rows zero and padding requests finite."""
    kv_cache = case.kv_cache.clone()
    out = backend.forward(*case.args(kv_cache), indexer=case.indexer)
    layer, metadata = case.layer, case.metadata
    num_tokens = metadata.num_tokens
    assert out.shape == (case.q_nope.shape[0], layer.num_heads, layer.v_head_dim) and out.dtype == case.q_nope.dtype
    topk = None
    if layer.index_topk and metadata.max_seq_len > layer.index_topk:
        topk = backend.indexer_topk(layer, case.indexer, kv_cache, metadata)
        check_topk(case, topk)
    expected_cache = case.kv_cache.clone()
    step_rows = [case.kv_c, case.k_pe] + ([case.indexer.k] if case.indexer is not None else [])
    flat = expected_cache.view(-1, layer.cache_dim)
    slots = metadata.slot_mapping[:num_tokens]
    stored = slots >= 0
    flat[slots[stored]] = torch.cat(step_rows, dim=1)[:num_tokens][stored].to(flat.dtype)
    torch.testing.assert_close(kv_cache, expected_cache, atol=0, rtol=0, equal_nan=True)
    assert torch.all(out[num_tokens:] == 0), "padding rows must be left zero"
    assert torch.isfinite(out[:num_tokens]).all(), "read a slot it must not (NaN came out)"
    for req, expected in oracle_mla(case, topk).items():
        begin, end = (int(x) for x in metadata.query_start_loc[req: req + 2])
        error = relative_error(out[begin:end].double().cpu(), expected)
        assert error < TOLERANCE[case.q_nope.dtype], f"request {req}: relative error {error:.2e}"
    return out


def mla_backend(dtype, device, block_size, *, splits=None, topk=None, tiles=None, kernel=None, scores=None):
    """``topk``: (block, counting) of the top-k kernel: a score row of at most ``block`` keys stays
    resident (found by counting or by radix passes), a longer one streams. ``kernel``: the
    attention kernel, "wgmma" (skips where it cannot run) or "triton"; None: the backend's choice.
    ``scores``: (shortest query that takes the block-of-tokens indexer kernel, its ScoreTiles)."""
    from weir.plugins.attention.mla_triton import TritonMLABackend, wgmma_supported

    backend = TritonMLABackend(block_size, dtype, torch.device(device))
    backend.forced_num_splits, backend.attention_tiles = splits, tiles
    if topk is not None:
        backend.topk_block, backend.topk_counting = topk
    if scores is not None:
        backend.block_scores_min_query_len, backend.block_score_tiles = scores
    if kernel == "wgmma" and not wgmma_supported(torch.device(device), dtype):
        pytest.skip("the wgmma kernel needs a Hopper GPU and a 16-bit dtype")
    backend.attention_kernel = kernel or backend.attention_kernel
    if kernel == "wgmma":  # a silent fallback to the Triton kernel would pass as the Gluon one
        chosen = backend.kernel_for

        def gluon_only(*args):
            assert chosen(*args) == "wgmma", "the inputs fell back to the Triton kernel"
            return "wgmma"

        backend.kernel_for = gluon_only
    return backend


def attention_kernels(device: str, dtype: torch.dtype) -> list[str]:
    """The attention kernels that run on ``device`` in ``dtype``."""
    from weir.plugins.attention.mla_triton import wgmma_supported

    return ["triton"] + (["wgmma"] if wgmma_supported(torch.device(device), dtype) else [])


# Top-k kernel variants on rows of up to 63 keys: every row resident (by radix passes, by counting),
# and a 16-key block, past which rows stream while shorter ones stay resident (each way).
TOPK_VARIANTS = [(64, False), (64, True), (16, False), (16, True)]


# ---- the kernels against the oracle: interpreted on the CPU, compiled on CUDA -------------------

# (query_lens, seq_lens): varlen prefill, chunks after a long cached prefix, mixed, decode;
# lengths straddle blocks (4) and key tiles (16).
DENSE_BATCHES = {
    "prefill": ([9, 2, 17], [9, 2, 17]),
    "chunked_prefix": ([5, 3], [61, 19]),
    "mixed": ([1, 6, 1, 5], [20, 12, 3, 37]),
    "decode": ([1, 1, 1, 1], [1, 9, 17, 40]),
}


def check_dense_batch_kinds(device: str) -> None:
    layer = mla_layer(TINY)
    for query_lens, seq_lens in DENSE_BATCHES.values():
        case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=torch.float32, device=device)
        check_backend(mla_backend(torch.float32, device, 4), case)


def check_decode_split_k_and_padding_requests(device: str) -> None:
    """Split-K decode (splits 1, 3 with an empty split for short requests, 7), beside padding
    requests of seq_len 0 and 1 whose table row is the null block."""
    layer = mla_layer(TINY)
    query_lens, seq_lens = [1] * 5, [3, 40, 0, 77, 1]
    for splits in (1, 3, 7):
        case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=torch.float32, device=device,
                             padding_reqs=(2, 4), seed=splits)
        check_backend(mla_backend(torch.float32, device, 4, splits=splits), case)


def check_heads_past_one_block(device: str) -> None:
    """20 heads: two head blocks, the second partly padding, in prefill and split decode."""
    layer = mla_layer(dict(TINY, num_heads=20))
    for (query_lens, seq_lens), splits in ((DENSE_BATCHES["mixed"], None), (DENSE_BATCHES["decode"], 2)):
        case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=torch.float32, device=device)
        check_backend(mla_backend(torch.float32, device, 4, splits=splits), case)


SPARSE_BATCHES = {  # index_topk = 8: prefixes below, at and far above it
    "prefill": ([9, 3, 20], [9, 3, 20]),
    "chunked_prefix": ([5, 3], [45, 11]),
    "mixed": ([1, 6, 1, 5], [30, 12, 5, 37]),
    "decode": ([1, 1, 1, 1, 1], [2, 8, 9, 40, 63]),
}


def check_sparse_batch_kinds(device: str) -> None:
    """Top-k below and above the prefix; score rows resident in one top-k block and streamed."""
    layer = mla_layer(TINY, TINY_INDEXER)
    for (query_lens, seq_lens), topk in itertools.product(SPARSE_BATCHES.values(), TOPK_VARIANTS):
        case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=torch.float32, device=device)
        check_backend(mla_backend(torch.float32, device, 4, topk=topk), case)


def indexer_score_cases(device: str) -> list[MLACase]:
    """Every sparse batch kind, decode beside graph padding requests (seq_len 0 and 1), and a mixed
    step padded as its graph runs it (tokens owned by no request)."""
    layer = mla_layer(TINY, TINY_INDEXER)
    cases = [make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=torch.float32, device=device)
             for query_lens, seq_lens in SPARSE_BATCHES.values()]
    cases.append(make_mla_case([1] * 5, [30, 0, 13, 50, 1], layer, block_size=4, dtype=torch.float32, device=device,
                               padding_reqs=(1, 4)))
    mixed = make_mla_case(*SPARSE_BATCHES["mixed"], layer, block_size=4, dtype=torch.float32, device=device,
                          num_padding_tokens=5, max_blocks_per_req=12)
    cases.append(padded_as_a_mixed_graph(mixed, num_padding_reqs=3, max_seq_len=48))
    return cases


def expected_score_rows(case: MLACase, first_token: int, rows: int, width: int) -> torch.Tensor:
    """[rows, width] float64: the oracle's score where a row's token sees the key, NaN where the
    kernel must write nothing (future keys, spare columns, tokens owned by no request), and +inf
    for rows of graph padding requests, whose values nothing reads (not compared)."""
    expected = torch.full((rows, width), float("nan"), dtype=torch.float64)
    metadata = case.metadata
    for req in range(metadata.num_reqs):
        begin, end = (int(x) for x in metadata.query_start_loc[req: req + 2])
        lo, hi = max(begin, first_token), min(end, first_token + rows)
        if lo >= hi:
            continue
        if req in case.padding_reqs:
            expected[lo - first_token: hi - first_token] = float("inf")
            continue
        scores = oracle_indexer_scores(case, req)[lo - begin: hi - begin]  # [hi - lo, seq_len], -inf: future
        expected[lo - first_token: hi - first_token, : scores.shape[1]] = scores.masked_fill(scores == float("-inf"),
                                                                                          float("nan"))
    return expected


def check_indexer_score_kernels(device: str) -> None:
    """Both indexer kernels, called alone into a NaN buffer with spare rows and columns: one token
    a program (forced on prefills too), and blocks of 2, 4 and 8 tokens (forced on decode too)
    whose blocks straddle requests, span several, hold graph padding and tokens owned by no
    request, or end past the pass's rows. Every entry a token sees equals the oracle's score, and
    nothing else is written: not a future key, a spare column, a row past the pass or a token
    owned by no request."""
    from weir.plugins.attention.mla_triton import ScoreTiles

    one_token = (1 << 30, None)
    blocks = [(1, ScoreTiles(block_t, 16, 4, 2)) for block_t in (2, 4, 8)]
    for case, scores in itertools.product(indexer_score_cases(device), [one_token] + blocks):
        layer, metadata = case.layer, case.metadata
        backend = mla_backend(torch.float32, device, 4, scores=scores)
        kv_cache = case.kv_cache.clone()
        backend.store(layer, case.kv_c, case.k_pe, case.indexer, kv_cache, metadata.slot_mapping[:metadata.num_tokens])
        width = metadata.max_seq_len + 5
        for first_token, rows in ((0, metadata.num_tokens), (2, 3)):
            buffer = torch.full((rows + 2, width), float("nan"), device=device)
            backend.indexer_scores(layer, case.indexer, kv_cache, metadata, buffer, first_token, rows)
            written = buffer.double().cpu()
            assert torch.isnan(written[rows:]).all(), "wrote a row past the pass"
            expected = expected_score_rows(case, first_token, rows, width)
            compared = ~torch.isinf(expected)
            torch.testing.assert_close(written[:rows][compared], expected[compared], rtol=1e-5, atol=1e-6,
                                       equal_nan=True, msg=lambda text: f"{scores}, pass from {first_token}: {text}")


def check_layers_sharing_a_topk(device: str) -> None:
    """A sparse layer with no indexer of its own (GLM-5's "shared" layers; its cache has no indexer
    columns) attends to the slot lists the last layer with one left in the forward's
    SelectedKeys: its output is the oracle's over that layer's picks. It refuses to run before
    any layer picked."""
    from weir.mla import SelectedKeys

    layer = mla_layer(TINY, TINY_INDEXER)
    sharing = replace(layer, layer_idx=1, index_n_heads=0, index_head_dim=0, shares_topk=True)
    assert sharing.cache_dim == layer.latent_dim
    for query_lens, seq_lens in (SPARSE_BATCHES["mixed"], SPARSE_BATCHES["decode"]):
        case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=torch.float32, device=device)
        backend = mla_backend(torch.float32, device, 4)
        kv_cache = case.kv_cache.clone()
        selected = SelectedKeys()
        backend.forward(*case.args(kv_cache), indexer=case.indexer, selected=selected)
        assert selected.keys is not None
        picked = backend.indexer_topk(layer, case.indexer, kv_cache, case.metadata)  # positions, for the oracle
        shared = replace(case, layer=sharing, kv_cache=case.kv_cache[..., :layer.latent_dim].contiguous(),
                         indexer=None)
        out = backend.forward(*shared.args(shared.kv_cache.clone()), selected=selected)
        for req, expected in oracle_mla(shared, picked).items():
            begin, end = (int(x) for x in case.metadata.query_start_loc[req: req + 2])
            error = relative_error(out[begin:end].double().cpu(), expected)
            assert error < TOLERANCE[torch.float32], f"request {req}: relative error {error:.2e}"
        with pytest.raises(RuntimeError, match="no sparse layer with an indexer ran before it"):
            backend.forward(*shared.args(shared.kv_cache.clone()), selected=SelectedKeys())
        with pytest.raises(ValueError, match="shares another layer's top-k but forward got no SelectedKeys"):
            backend.forward(*shared.args(shared.kv_cache.clone()))


def check_sparse_decode_splits_and_padding(device: str) -> None:
    layer = mla_layer(TINY, dict(TINY_INDEXER, index_topk=12))
    query_lens, seq_lens = [1] * 5, [30, 0, 13, 50, 1]
    for splits in (2, 5):
        case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=torch.float32, device=device,
                             padding_reqs=(1, 4), seed=splits)
        check_backend(mla_backend(torch.float32, device, 4, splits=splits), case)


def check_sparse_ties_and_short_sequences(device: str) -> None:
    """Every key of a request (or every second one) scores the same: any index_topk of the tied
    ones is a right answer, and exactly that many distinct ones must come back. A batch whose sequences all fit in
    index_topk runs dense."""
    layer = mla_layer(TINY, TINY_INDEXER)
    for topk, tie_every in itertools.product(TOPK_VARIANTS, (1, 2)):
        case = make_mla_case([3, 1, 4], [30, 21, 12], layer, block_size=4, dtype=torch.float32, device=device,
                             tie_every=tie_every)
        check_backend(mla_backend(torch.float32, device, 4, topk=topk), case)
    short = make_mla_case([3, 1, 8], [8, 5, 8], layer, block_size=4, dtype=torch.float32, device=device)
    check_backend(mla_backend(torch.float32, device, 4), short)


def check_sixteen_bit(device: str) -> None:
    # The interpreter's bf16 tl.dot is wrong (seen with triton 3.9): bf16 runs on CUDA only.
    dtypes = [torch.float16] if device == "cpu" else [torch.float16, torch.bfloat16]
    for dtype in dtypes:
        for layer in (mla_layer(TINY), mla_layer(TINY, TINY_INDEXER)):
            query_lens, seq_lens = SPARSE_BATCHES["mixed"]
            case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=dtype, device=device)
            for kernel in attention_kernels(device, dtype):
                check_backend(mla_backend(dtype, device, 4, kernel=kernel), case)


def padded_as_a_mixed_graph(case: MLACase, num_padding_reqs: int, max_seq_len: int) -> MLACase:
    """The step as a mixed-step graph runs it: ``num_padding_reqs`` requests owning no token
    (seq_len 0), every row a token, those past the last request's owned
    by none, and the graph's baked bounds (the longest query the shape holds, ``max_seq_len``)."""
    m = case.metadata
    rows, num_reqs = case.q_nope.shape[0], m.num_reqs + num_padding_reqs
    device = m.query_start_loc.device
    metadata = AttentionMetadata(
        query_start_loc=torch.cat([m.query_start_loc, m.query_start_loc[-1:].repeat(num_padding_reqs)]),
        seq_lens=torch.cat([m.seq_lens, torch.zeros(num_padding_reqs, dtype=torch.int32, device=device)]),
        # Their rows name a never-owned block (NaN): a token owned by none must read no key.
        block_tables=torch.cat([m.block_tables, m.block_tables[:1, -1:].expand(num_padding_reqs, m.block_tables.shape[1])]),
        slot_mapping=m.slot_mapping, num_reqs=num_reqs, num_tokens=rows, max_query_len=rows - num_reqs + 1,
        max_seq_len=max_seq_len, has_unowned_tokens=True)
    return replace(case, metadata=metadata, padding_reqs=case.padding_reqs | set(range(m.num_reqs, num_reqs)))


def check_tokens_owned_by_no_request(device: str) -> None:
    """A mixed step padded as its graph runs it, dense and sparse: the real requests' rows as
    unpadded, the rows of tokens past the last request zero (a MoE router reads them next), and
    their top-k lists empty. The cache's NaN rows show any key such a token would read. On CUDA
    also in bf16 through each attention kernel."""
    runs = [(torch.float32, None)] + ([(torch.bfloat16, kernel) for kernel in attention_kernels(device, torch.bfloat16)]
                                      if device != "cpu" else [])
    for (dtype, kernel), layer in itertools.product(runs, (mla_layer(TINY), mla_layer(TINY, TINY_INDEXER))):
        query_lens, seq_lens = SPARSE_BATCHES["mixed"]
        case = make_mla_case(query_lens, seq_lens, layer, block_size=4, dtype=dtype, device=device,
                             num_padding_tokens=5, max_blocks_per_req=12)
        padded = padded_as_a_mixed_graph(case, num_padding_reqs=3, max_seq_len=48)
        backend = mla_backend(dtype, device, 4, kernel=kernel)
        out = check_backend(backend, padded)
        real_tokens = sum(query_lens)
        assert torch.all(out[real_tokens:] == 0), "rows of tokens owned by no request must come out zero"
        if layer.index_topk:
            topk = backend.indexer_topk(layer, padded.indexer, padded.kv_cache.clone(), padded.metadata)
            assert torch.all(topk[real_tokens:] == -1)


CHECKS = [check_dense_batch_kinds, check_decode_split_k_and_padding_requests, check_heads_past_one_block,
          check_sparse_batch_kinds, check_indexer_score_kernels, check_layers_sharing_a_topk,
          check_sparse_decode_splits_and_padding, check_sparse_ties_and_short_sequences, check_sixteen_bit,
          check_tokens_owned_by_no_request]

test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_mla_triton", CHECKS)


# ---- CPU: the oracle itself, host-side planning, registration and input checks -------------------

def test_oracle_expanded_matches_absorbed_form():
    """Guards the oracle: the absorbed form computed independently in float64 agrees with it,
    and sparsity changes the result (the top-k mask is not a no-op)."""
    layer = mla_layer(TINY)
    case = make_mla_case([5, 3], [30, 19], layer, block_size=4, dtype=torch.float64, device="cpu")
    expanded = oracle_mla(case)
    for req in (0, 1):
        begin, end = (int(x) for x in case.metadata.query_start_loc[req: req + 2])
        latent = request_rows(case, req, 0, layer.kv_lora_rank, case.kv_c)
        k_pe = request_rows(case, req, layer.kv_lora_rank, layer.latent_dim, case.k_pe)
        q_lat = torch.einsum("qhd,hdl->qhl", case.q_nope[begin:end], case.w_uk)
        scores = (torch.einsum("qhl,sl->hqs", q_lat, latent) + torch.einsum("qhr,sr->hqs", case.q_pe[begin:end], k_pe))
        probs = torch.softmax((scores * layer.scale).masked_fill(~causal_mask(case, req), float("-inf")), dim=-1)
        absorbed = torch.einsum("hvl,qhl->qhv", case.w_uv, torch.einsum("hqs,sl->qhl", probs, latent))
        torch.testing.assert_close(expanded[req], absorbed, atol=1e-12, rtol=1e-10)
    first_keys = torch.full((case.metadata.num_tokens, 4), -1, dtype=torch.int32)
    first_keys[:, :4] = torch.arange(4, dtype=torch.int32)
    assert (oracle_mla(case, first_keys)[0] - expanded[0]).abs().max() > 1e-2


def test_poisoned_cache_reads_show_as_nan():
    """The oracle reading the whole block-table row instead of the request's positions hits NaN."""
    case = make_mla_case([2], [9], mla_layer(TINY), block_size=4, dtype=torch.float32, device="cpu")
    table = case.metadata.block_tables[0]
    assert torch.isnan(case.kv_cache[table[-1]]).all(), "unused table entries point at a poisoned block"
    assert torch.isnan(case.kv_cache[table[1], 3]).all(), "this step's slots are poisoned until stored"
    assert torch.isfinite(case.kv_cache[0]).all()


def test_registered_for_mla_kinds_on_cuda_only():
    from weir.mla import MLA, SPARSE_MLA
    from weir.plugin_manager import load_plugins
    from weir.plugins.attention.mla_triton import TritonMLABackend

    registry = load_plugins({"builtin_platforms", "builtin_attention"})
    assert registry.resolve_attention_backend("triton_mla") is TritonMLABackend
    assert TritonMLABackend.supports("cuda", {MLA, SPARSE_MLA})
    assert not TritonMLABackend.supports("cpu", {MLA})
    assert not TritonMLABackend.supports("cuda", {"full_attention"})
    assert TritonMLABackend.supports_cuda_graphs


def test_attention_kernel_choice():
    """The Gluon kernel only where it compiles (Hopper, 16-bit), and only on 16-byte aligned rows;
    the Triton kernel elsewhere, with a head block sized for tl.dot."""
    from weir.plugins.attention.mla_triton import wgmma_aligned, wgmma_fits, wgmma_supported

    assert not wgmma_supported(torch.device("cpu"), torch.bfloat16)
    assert mla_backend(torch.bfloat16, "cpu", 64).attention_kernel == "triton"
    backend = mla_backend(torch.float32, "cpu", 4)
    assert backend.head_blocks(mla_layer(TINY)) == (16, 1)
    assert backend.head_blocks(mla_layer(TINY), "wgmma") == (64, 1)
    assert backend.head_blocks(mla_layer(DEEPSEEK), "wgmma") == (64, 2)
    rows = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    assert wgmma_aligned(rows, rows[:, :, 16:32])
    assert not wgmma_aligned(rows[:, :, 1:17]), "a base 2 bytes past a 16-byte boundary"
    assert not wgmma_aligned(torch.zeros(8, 24, dtype=torch.bfloat16)[:, :16]), "rows 48 bytes apart"
    assert wgmma_fits(mla_layer(DEEPSEEK)) and wgmma_fits(mla_layer(TINY))
    assert not wgmma_fits(mla_layer(dict(DEEPSEEK, qk_rope_head_dim=128))), "254 KiB of shared memory"
    assert not wgmma_fits(mla_layer(dict(DEEPSEEK, kv_lora_rank=1024)))
    rows, cache = torch.zeros(4, 2, 32), torch.zeros(2, 4, 48, dtype=torch.bfloat16)
    backend.attention_kernel = "wgmma"  # as on a Hopper GPU
    assert backend.layer_kernel(mla_layer(dict(DEEPSEEK, kv_lora_rank=1024))) == "triton"
    assert backend.kernel_for(mla_layer(TINY), rows.bfloat16(), rows[..., :16].bfloat16(), cache) == "wgmma"
    assert backend.kernel_for(mla_layer(TINY), rows, rows[..., :16].bfloat16(), cache) == "triton", "q in fp32"


@pytest.mark.integration
@pytest.mark.parametrize("shape", [DEEPSEEK, TINY], ids=["deepseek", "tiny"])
def test_gluon_kernel_compiles_for_hopper(shape):
    """Gluon has no CPU interpreter, so CI compiles the Hopper kernel instead: its four constexpr
    variants (dense and sparse, with and without key splits, every stride but stride_bt 16-aligned)
    down to an sm_90a binary with the installed triton's ptxas, in the shared memory an H100/H200
    block can hold, the compiler's scratch within the margin ``wgmma_fits`` leaves it. The GPU
    tests check what it computes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as compile_kernel
    from triton.experimental.gluon._runtime import GluonASTSource

    from weir.plugins.attention import mla_gluon_kernels

    kernel = mla_gluon_kernels.mla_attention_wgmma_kernel
    pointer_types = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", cache_ptr="*bf16", o_lat_ptr="*bf16",
                         partial_out_ptr="*fp32", partial_lse_ptr="*fp32", qk_scale="fp32")
    signature = {name: "constexpr" if name.isupper() else pointer_types.get(name, "*i32" if name.endswith("_ptr")
                                                                            else "i32")
                 for name in kernel.arg_names}
    # What the launcher tells the compiler of 16-aligned pointers and of strides divisible by 16
    # (the rows the backend sends here: wgmma_aligned); stride_bt is never specialised.
    aligned = [(index,) for index, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_bt")]
    for sparse, split in itertools.product((False, True), repeat=2):
        constants = dict(NUM_HEADS=shape["num_heads"], LORA=shape["kv_lora_rank"], ROPE=shape["qk_rope_head_dim"],
                         BLOCK_SIZE=64, SPARSE=sparse, SPLIT=split, BLOCK_H=mla_gluon_kernels.BLOCK_H,
                         BLOCK_N=mla_gluon_kernels.BLOCK_N)  # the launch's defaults, which compile() does not fill
        source = GluonASTSource(kernel, signature, constants, {key: [["tt.divisibility", 16]] for key in aligned})
        compiled = compile_kernel(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": mla_gluon_kernels.NUM_WARPS})
        assert compiled.asm["cubin"], (sparse, split)
        assert "wgmma.mma_async" in compiled.asm["ptx"]
        own_bytes = mla_gluon_kernels.shared_bytes(shape["kv_lora_rank"], shape["qk_rope_head_dim"])
        assert own_bytes <= compiled.metadata.shared <= own_bytes + mla_gluon_kernels.COMPILER_SCRATCH_BYTES, (
            sparse, split, compiled.metadata.shared)
        assert compiled.metadata.shared <= mla_gluon_kernels.HOPPER_BLOCK_SHARED_BYTES


def test_cache_shape_and_layer_checks():
    backend = mla_backend(torch.bfloat16, "cpu", 64)
    assert backend.kv_cache_shape(10, mla_layer(DEEPSEEK)) == (10, 64, 576)
    assert backend.kv_cache_shape(10, mla_layer(DEEPSEEK, DEEPSEEK_INDEXER)) == (10, 64, 704)
    assert backend.kv_cache_bytes_per_block(mla_layer(DEEPSEEK)) == 64 * 576 * 2
    with pytest.raises(ValueError, match="kv_lora_rank a power of two >= 16, got 500"):
        backend.kv_cache_shape(10, mla_layer(dict(DEEPSEEK, kv_lora_rank=500)))
    with pytest.raises(ValueError, match="index_head_dim a power of two >= 16, got 96"):
        backend.kv_cache_shape(10, mla_layer(DEEPSEEK, dict(DEEPSEEK_INDEXER, index_head_dim=96)))


def test_forward_refuses_bad_inputs():
    backend = mla_backend(torch.float32, "cpu", 4)
    dense = make_mla_case([2], [5], mla_layer(TINY), block_size=4, dtype=torch.float32, device="cpu")
    sparse = make_mla_case([2], [5], mla_layer(TINY, TINY_INDEXER), block_size=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="is sparse .* but forward got no indexer inputs"):
        backend.forward(*sparse.args(sparse.kv_cache))
    with pytest.raises(ValueError, match="is dense .* but forward got indexer inputs"):
        backend.forward(*dense.args(dense.kv_cache), indexer=sparse.indexer)
    with pytest.raises(ValueError, match=r"kv_c must be \[4, 32\], got \[4, 31\]"):
        args = list(dense.args(dense.kv_cache))
        args[3] = dense.kv_c[:, :31]
        backend.forward(*args)
    with pytest.raises(ValueError, match="k_pe must have a unit last stride"):
        args = list(dense.args(dense.kv_cache))
        args[4] = torch.zeros(16, 4).t()
        backend.forward(*args)
    with pytest.raises(ValueError, match="indexer.weights must be float32"):
        bad = IndexerInputs(sparse.indexer.q, sparse.indexer.k, sparse.indexer.weights.double())
        backend.forward(*sparse.args(sparse.kv_cache), indexer=bad)


def test_decode_splits_follow_the_batch_and_the_keys_read():
    from weir.plugins.attention.mla_triton import MAX_SPLITS, TOPK_BLOCK

    backend = mla_backend(torch.bfloat16, "cpu", 64)
    backend.num_sms = 132
    dense, sparse = mla_layer(DEEPSEEK), mla_layer(DEEPSEEK, DEEPSEEK_INDEXER)
    assert backend.head_blocks(dense) == (64, 2)
    assert backend.plan(dense, 1, 1, 16384).num_splits == MAX_SPLITS
    assert backend.plan(dense, 256, 1, 16384).num_splits == 1  # the batch fills the GPU
    assert backend.plan(dense, 1, 1, 100).num_splits == 1  # too short to split
    assert backend.plan(dense, 4, 2, 16384).num_splits == 1  # prefill and mixed batches never split
    decode_sparse = backend.plan(sparse, 1, 1, 16384)
    assert decode_sparse.sparse and decode_sparse.num_splits == 2048 // 256  # split the 2048 selected keys
    assert not backend.plan(sparse, 1, 1, 2048).sparse  # every key is selected: dense
    assert backend.plan(sparse, 8, 4, TOPK_BLOCK).topk_all_fit
    assert not backend.plan(sparse, 8, 4, TOPK_BLOCK + 1).topk_all_fit



def test_warmup_names_one_shape_per_variant():
    backend = mla_backend(torch.bfloat16, "cpu", 64)
    backend.num_sms = 132
    dense, sparse = mla_layer(DEEPSEEK), mla_layer(DEEPSEEK, DEEPSEEK_INDEXER)
    for layer in (dense, sparse):
        shapes = backend.warmup_shapes(layer, 256, [256, 64, 8, 1], 16384)
        variants = [backend.plan(layer, sum(q), max(q), max(s)).variant for q, s in shapes]
        assert len(variants) == len(set(variants)), "one shape per variant"
        assert len([shape for shape in shapes if max(shape[0]) == 1]) >= 3, "decode split classes 1, 4 and 64"
        assert all(s >= q for query_lens, seq_lens in shapes for q, s in zip(query_lens, seq_lens))
    sparse_variants = {backend.plan(sparse, sum(q), max(q), max(s)).variant
                       for q, s in backend.warmup_shapes(sparse, 256, [256, 1], 32768)}
    # every row resident; rows of both paths
    assert (True, 1, True) in sparse_variants and (True, 1, False) in sparse_variants
    assert (False, 1, None) in sparse_variants  # short prefills run dense


# ---- GPU only: DeepSeek's shapes in bf16, CUDA graphs, no host sync ------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_DENSE_BATCHES = {
    "prefill": ([300, 64, 5, 1030], [300, 64, 5, 1030]),
    "chunked_prefix": ([40, 17, 128, 3], [4140, 17 + 300, 128 + 64, 1003]),
    "mixed": ([1, 33, 1, 7, 1, 200], [3000, 33 + 80, 1, 7, 64, 200 + 31]),
    "decode": ([1] * 7, [1, 15, 16, 17, 300, 1000, 5000]),
}
GPU_SPARSE_BATCHES = {  # index_topk 2048
    "chunked_prefix": ([64, 30, 5], [2500, 30 + 2100, 1000]),
    "mixed": ([1, 40, 1, 1], [4100, 40 + 2047, 2048, 10]),
    "decode": ([1] * 6, [1, 100, 2048, 2049, 3000, 9000]),
}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("batch", list(GPU_DENSE_BATCHES))
@pytest.mark.parametrize("kernel", ["wgmma", "triton"])
def test_gpu_deepseek_dense_bf16(batch, block_size, kernel):
    query_lens, seq_lens = GPU_DENSE_BATCHES[batch]
    case = make_mla_case(query_lens, seq_lens, mla_layer(DEEPSEEK), block_size=block_size, dtype=torch.bfloat16,
                         device="cuda", num_padding_tokens=3)
    check_backend(mla_backend(torch.bfloat16, "cuda", block_size, kernel=kernel), case)


@cuda
@pytest.mark.gpu
# (block, counting): rows past a 4096 block stream while shorter ones of the launch stay resident.
@pytest.mark.parametrize("topk", [None, (16384, False), (4096, False), (4096, True)],
                         ids=["default", "radix", "mixed_radix", "mixed_counting"])
@pytest.mark.parametrize("batch", list(GPU_SPARSE_BATCHES))
@pytest.mark.parametrize("kernel", ["wgmma", "triton"])
def test_gpu_deepseek_sparse_bf16(batch, topk, kernel):
    query_lens, seq_lens = GPU_SPARSE_BATCHES[batch]
    case = make_mla_case(query_lens, seq_lens, mla_layer(DEEPSEEK, DEEPSEEK_INDEXER), block_size=64,
                         dtype=torch.bfloat16, device="cuda", num_padding_tokens=3)
    check_backend(mla_backend(torch.bfloat16, "cuda", 64, topk=topk, kernel=kernel), case)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 5, 64])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("kernel", ["wgmma", "triton"])
def test_gpu_split_k_decode_with_padding(sparse, num_splits, kernel):
    layer = mla_layer(DEEPSEEK, DEEPSEEK_INDEXER if sparse else None)
    case = make_mla_case([1] * 6, [5000, 0, 2100, 17, 1, 3000], layer, block_size=64, dtype=torch.bfloat16,
                         device="cuda", padding_reqs=(1, 4))
    check_backend(mla_backend(torch.bfloat16, "cuda", 64, splits=num_splits, kernel=kernel), case)


@cuda
@pytest.mark.gpu
def test_gpu_forward_makes_no_host_sync():
    backend = mla_backend(torch.bfloat16, "cuda", 64)
    for layer, batches in ((mla_layer(DEEPSEEK), GPU_DENSE_BATCHES), (mla_layer(DEEPSEEK, DEEPSEEK_INDEXER),
                                                                      GPU_SPARSE_BATCHES)):
        for batch in ("mixed", "decode"):
            case = make_mla_case(*batches[batch], layer, block_size=64, dtype=torch.bfloat16, device="cuda")
            backend.forward(*case.args(case.kv_cache), indexer=case.indexer)  # compile first
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                backend.forward(*case.args(case.kv_cache), indexer=case.indexer)
            finally:
                torch.cuda.set_sync_debug_mode(0)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gpu_decode_graph_replays_with_new_lengths(sparse):
    """Capture a padded split-K decode once, then replay it on other lengths, blocks and values
    (the capture-time max_seq_len bound decides the splits and the top-k variant)."""
    layer = mla_layer(DEEPSEEK, DEEPSEEK_INDEXER if sparse else None)
    shape = dict(block_size=64, dtype=torch.bfloat16, device="cuda", num_padding_tokens=1, padding_reqs=(7,),
                 num_blocks=300, max_blocks_per_req=130)
    query_lens = [1] * 8
    captured = make_mla_case(query_lens, [5, 70, 16, 2100, 33, 900, 8000, 1], layer, seed=0, **shape)
    captured.metadata.max_seq_len = 8192
    backend = mla_backend(torch.bfloat16, "cuda", 64)
    assert backend.plan(layer, 8, 1, 8192).num_splits > 1, "the graph should cover split-K"
    static = captured.args(captured.kv_cache)
    backend.forward(*static, indexer=captured.indexer)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(*static, indexer=captured.indexer)

    fresh = make_mla_case(query_lens, [8000, 1, 2500, 64, 2049, 3, 1500, 0], layer, seed=1, **shape)
    fresh.metadata.max_seq_len = 8192  # eager runs the captured plan too
    for name in ("q_nope", "q_pe", "kv_c", "k_pe", "kv_cache", "w_uk", "w_uv"):
        getattr(captured, name).copy_(getattr(fresh, name))
    if sparse:
        for name in ("q", "k", "weights"):
            getattr(captured.indexer, name).copy_(getattr(fresh.indexer, name))
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        getattr(captured.metadata, name).copy_(getattr(fresh.metadata, name))
    expected = check_backend(backend, fresh)  # eager, on a copy of the fresh cache
    graph.replay()
    torch.testing.assert_close(graph_out[:7], expected[:7], atol=2e-2, rtol=2e-2)
    assert torch.all(graph_out[8:] == 0)
