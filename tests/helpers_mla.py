"""Random MLA / DSA steps over a paged latent cache, an independent float64 oracle, and the check
of an MLA backend against the torch reference (``weir.plugins.attention.mla_torch``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from weir.attention import AttentionMetadata
from weir.mla import IndexerInputs, MLALayerSpec


def mla_layer(*, num_heads: int = 4, kv_lora_rank: int = 32, qk_nope_head_dim: int = 16, qk_rope_head_dim: int = 8,
              v_head_dim: int = 24, index_n_heads: int = 0, index_head_dim: int = 0, index_topk: int = 0,
              scale: float | None = None) -> MLALayerSpec:
    return MLALayerSpec(
        layer_idx=0, num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        scale=scale if scale is not None else (qk_nope_head_dim + qk_rope_head_dim) ** -0.5,
        index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=index_topk)


def sparse_layer(index_topk: int, **fields) -> MLALayerSpec:
    return mla_layer(index_n_heads=8, index_head_dim=16, index_topk=index_topk, **fields)


@dataclass
class MLACase:
    layer: MLALayerSpec
    q_nope: torch.Tensor  # [num_tokens + padding, H, qk_nope]
    q_pe: torch.Tensor  # [num_tokens + padding, H, qk_rope]
    kv_c: torch.Tensor  # [num_tokens + padding, kv_lora_rank]
    k_pe: torch.Tensor  # [num_tokens + padding, qk_rope]
    kv_cache: torch.Tensor  # [num_blocks, block_size, cache_dim]; block 0 = null block
    metadata: AttentionMetadata
    w_uk: torch.Tensor  # [H, qk_nope, kv_lora_rank], a view of one kv_b weight, as models pass it
    w_uv: torch.Tensor  # [H, v_head_dim, kv_lora_rank]
    indexer: IndexerInputs | None = None

    def args(self, kv_cache: torch.Tensor | None = None) -> tuple:
        """``MLABackend.forward``'s positional arguments (on ``kv_cache`` if given)."""
        return (self.layer, self.q_nope, self.q_pe, self.kv_c, self.k_pe,
                self.kv_cache if kv_cache is None else kv_cache, self.metadata, self.w_uk, self.w_uv)

    def with_layer(self, layer: MLALayerSpec) -> MLACase:
        """The same step for another layer with the same cache layout (another index_topk)."""
        return dataclasses.replace(self, layer=layer)


def make_mla_case(query_lens: list[int], seq_lens: list[int], layer: MLALayerSpec, *, block_size: int = 4,
                  dtype: torch.dtype = torch.float32, device: str = "cpu", num_padding_tokens: int = 0,
                  seed: int = 0, poison: bool = True) -> MLACase:
    """One step: request r has ``seq_lens[r] - query_lens[r]`` cached tokens (random rows in its
    blocks, which are handed out in a random order) and ``query_lens[r]`` new ones. Padding
    tokens get slot -1. ``poison``: every slot no request owns holds NaN, so a backend that reads
    past a request's keys returns NaN."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = 1 + sum(blocks_needed) + 3
    block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_needed) + 1, dtype=torch.int32)
    slots, owned_slots = [], []
    for req, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        table = [block_ids.pop() for _ in range(blocks_needed[req])]
        block_tables[req, : len(table)] = torch.tensor(table, dtype=torch.int32)
        req_slots = [table[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
        slots += req_slots[seq_len - query_len:]
        owned_slots += req_slots
    num_tokens = sum(query_lens)
    total = num_tokens + num_padding_tokens
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots + [-1] * num_padding_tokens, dtype=torch.int64).to(device),
        num_reqs=len(query_lens), num_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens))

    heads, rank = layer.num_heads, layer.kv_lora_rank
    kv_b = rand(heads * (layer.qk_nope_head_dim + layer.v_head_dim), rank, scale=rank ** -0.5)
    per_head = kv_b.view(heads, layer.qk_nope_head_dim + layer.v_head_dim, rank)
    kv_cache = rand(num_blocks, block_size, layer.cache_dim)
    if poison:
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        owned[torch.tensor(owned_slots, dtype=torch.long)] = True
        kv_cache.view(-1, layer.cache_dim)[~owned.to(device)] = float("nan")
    indexer = None
    if layer.index_topk:
        indexer = IndexerInputs(q=rand(total, layer.index_n_heads, layer.index_head_dim),
                                k=rand(total, layer.index_head_dim),
                                weights=rand(total, layer.index_n_heads).float())
    return MLACase(layer, rand(total, heads, layer.qk_nope_head_dim), rand(total, heads, layer.qk_rope_head_dim),
                   rand(total, rank), rand(total, layer.qk_rope_head_dim), kv_cache, metadata,
                   per_head[:, : layer.qk_nope_head_dim], per_head[:, layer.qk_nope_head_dim:], indexer)


def request_rows(case: MLACase, req: int) -> torch.Tensor:  # [seq_len, cache_dim] float64
    """Request ``req``'s cache rows as they must be after the step: its cached prefix read from
    its blocks, then this step's inputs."""
    layer, metadata = case.layer, case.metadata
    block_size = case.kv_cache.shape[1]
    seq_len = int(metadata.seq_lens[req])
    begin, end = int(metadata.query_start_loc[req]), int(metadata.query_start_loc[req + 1])
    context_len = seq_len - (end - begin)
    rows = torch.zeros(seq_len, layer.cache_dim, dtype=torch.float64)
    for pos in range(context_len):
        block = int(metadata.block_tables[req, pos // block_size])
        rows[pos] = case.kv_cache[block, pos % block_size].double().cpu()
    parts = [case.kv_c, case.k_pe] + ([case.indexer.k] if case.indexer is not None else [])
    rows[context_len:] = torch.cat([part[begin:end].double().cpu() for part in parts], dim=-1)
    return rows


def dense_oracle(case: MLACase) -> torch.Tensor:  # [num_tokens, H, v_head_dim] float64
    """Request by request in float64, expanded per head, with a materialised mask: causal and,
    for sparse layers, the index_topk best keys of each query by an explicit sort of its causal
    keys' indexer scores."""
    layer, metadata = case.layer, case.metadata
    rank, latent_dim = layer.kv_lora_rank, layer.latent_dim
    w_uk, w_uv = case.w_uk.double().cpu(), case.w_uv.double().cpu()
    outputs = []
    for req in range(metadata.num_reqs):
        rows = request_rows(case, req)
        seq_len = rows.shape[0]
        begin, end = int(metadata.query_start_loc[req]), int(metadata.query_start_loc[req + 1])
        context_len = seq_len - (end - begin)
        latent, rope_keys = rows[:, :rank], rows[:, rank:latent_dim]
        keys = torch.cat([torch.einsum("hnc,sc->shn", w_uk, latent),
                          rope_keys.unsqueeze(1).expand(-1, layer.num_heads, -1)], dim=-1)  # [S, H, N + P]
        values = torch.einsum("hvc,sc->shv", w_uv, latent)  # [S, H, V]
        queries = torch.cat([case.q_nope[begin:end], case.q_pe[begin:end]], dim=-1).double().cpu()  # [Q, H, N + P]
        visible = torch.zeros(end - begin, seq_len, dtype=torch.bool)
        for query in range(end - begin):
            position = context_len + query
            causal_keys = torch.arange(position + 1)
            if layer.index_topk:
                q_index = case.indexer.q[begin + query].double().cpu()  # [G, D]
                weights = case.indexer.weights[begin + query].double().cpu()  # [G]
                index_scores = (weights[:, None] * torch.relu(q_index @ rows[: position + 1, latent_dim:].T)).sum(0)
                causal_keys = causal_keys[torch.argsort(index_scores, descending=True)[: layer.index_topk]]
            visible[query, causal_keys] = True
        scores = torch.einsum("qhd,shd->hqs", queries, keys) * layer.scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outputs.append(torch.einsum("hqs,shv->qhv", probs, values))
    return torch.cat(outputs)


TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def check_mla_against_reference(backend, case: MLACase) -> torch.Tensor:
    """Run ``backend`` and the torch reference on copies of the cache; assert that outputs and
    the cache rows they wrote agree, and that padding rows come out zero."""
    from weir.plugins.attention.mla_torch import TorchMLABackend

    block_size = case.kv_cache.shape[1]
    reference = TorchMLABackend(block_size, case.q_nope.dtype, case.q_nope.device)
    expected_cache = case.kv_cache.clone()
    expected = reference.forward(*case.args(expected_cache), indexer=case.indexer)
    actual_cache = case.kv_cache.clone()
    actual = backend.forward(*case.args(actual_cache), indexer=case.indexer)
    num_tokens = case.metadata.num_tokens
    tolerance = TOLERANCE[case.q_nope.dtype]
    assert actual.shape == (case.q_nope.shape[0], case.layer.num_heads, case.layer.v_head_dim)
    assert torch.isfinite(expected[:num_tokens]).all(), "the reference read a slot it must not"
    torch.testing.assert_close(actual[:num_tokens].float(), expected[:num_tokens].float(), atol=tolerance,
                               rtol=tolerance)
    # The reference parks padding tokens in the null block 0; a backend may skip them.
    torch.testing.assert_close(actual_cache[1:], expected_cache[1:], atol=0, rtol=0, equal_nan=True)
    assert torch.all(actual[num_tokens:] == 0), "padding rows must be left zero"
    return actual
