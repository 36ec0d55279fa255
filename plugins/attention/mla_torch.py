"""Reference multi-head latent attention (MLA) and its sparse variant (DSA) over the paged latent
cache, in plain torch ops (``weir.mla`` states the maths and the cache layout).

It runs on every platform and is the oracle the fast MLA backends are tested against, so it
favours obvious correctness: this step's cache rows are stored first; then every request's rows
are gathered from its blocks into a padded ``[num_reqs, max_seq_len]`` view (masked positions
zeroed before any arithmetic: a slot outside a request may hold anything) and attended in fp32
with an explicit mask. Sparse layers score every causal key of the request with the indexer,
keep the ``index_topk`` best per query (all of them when fewer) and mask out the rest; layers
that share a top-k apply the mask the forward's last such layer left.

Both forms of the attention are here: expanded (per-head keys ``W_UK c`` and values ``W_UV c``,
as transformers computes it) and absorbed (``W_UK^T q_nope`` first, MQA over the latent, ``W_UV``
applied to the latent output, as decode kernels do). ``absorbed`` picks one per backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weir.attention import AttentionMetadata
from weir.mla import (MLA, SPARSE_MLA, IndexerInputs, MLABackend, MLALayerSpec, SelectedKeys, attended_keys,
                      check_forward_inputs)


def store_mla_rows(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                   index_k: torch.Tensor | None) -> None:
    """Write token t's ``[kv_c | k_pe (| index_k)]`` row at slot ``slot_mapping[t]``.

    Padding tokens (slot -1) go to slot 0, in the block pool's reserved null block, so no mask
    and no device sync is needed (as ``weir.kernels.kv_store.store_kv_torch`` does).
    """
    parts = [kv_c, k_pe] if index_k is None else [kv_c, k_pe, index_k]
    rows = torch.cat([part.to(kv_cache.dtype) for part in parts], dim=-1)  # [num_tokens, cache_dim]
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping.clamp_min(0), rows)


@dataclass
class PaddedStep:
    """One step's requests laid out as ``[num_reqs, max_query_len]`` queries over
    ``[num_reqs, max_seq_len]`` keys."""

    rows: torch.Tensor  # [R, S, cache_dim] fp32; zero where not key_valid
    key_valid: torch.Tensor  # [R, S] bool: position < seq_len
    token_of: torch.Tensor  # [R, Q] int64: flat token index of each query (0 for padded queries)
    causal: torch.Tensor  # [R, Q, S] bool: valid key at or before the query's position
    query_start: torch.Tensor  # [R + 1] int64


def pad_step(kv_cache: torch.Tensor, metadata: AttentionMetadata) -> PaddedStep:
    """Gather every request's cache rows and place its queries (query j of request r sits at
    position ``seq_len - query_len + j``)."""
    num_reqs, max_q, max_kv = metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len
    block_size = kv_cache.shape[1]
    device = kv_cache.device
    query_start = metadata.query_start_loc[: num_reqs + 1].long()
    seq_lens = metadata.seq_lens[:num_reqs].long()
    query_lens = query_start[1:] - query_start[:-1]  # [R]
    context_lens = seq_lens - query_lens  # [R]

    key_pos = torch.arange(max_kv, device=device)  # [S]
    key_valid = key_pos.unsqueeze(0) < seq_lens.unsqueeze(1)  # [R, S]
    read_pos = torch.where(key_valid, key_pos.unsqueeze(0), torch.zeros_like(key_valid, dtype=torch.long))
    max_blocks = -(-max_kv // block_size)
    blocks = metadata.block_tables[:num_reqs, :max_blocks].long()  # [R, nb]
    slots = blocks.gather(1, read_pos // block_size) * block_size + read_pos % block_size  # [R, S]
    flat_cache = kv_cache.view(-1, kv_cache.shape[-1])
    # where, not a multiply: a slot past a request's end may hold NaN (a reused block's tail).
    rows = torch.where(key_valid.unsqueeze(-1), flat_cache[slots].float(), 0.0)  # [R, S, cache_dim]

    query_idx = torch.arange(max_q, device=device)  # [Q]
    query_valid = query_idx.unsqueeze(0) < query_lens.unsqueeze(1)  # [R, Q]
    token_of = torch.where(query_valid, query_start[:-1].unsqueeze(1) + query_idx,
                           torch.zeros_like(query_valid, dtype=torch.long))
    query_pos = context_lens.unsqueeze(1) + query_idx  # [R, Q]
    causal = (key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)) & key_valid.unsqueeze(1)  # [R, Q, S]
    return PaddedStep(rows, key_valid, token_of, causal, query_start)


def indexer_keep_mask(indexer: IndexerInputs, index_keys: torch.Tensor, step: PaddedStep,
                      index_topk: int) -> torch.Tensor:  # [R, Q, S] bool
    """The keys each query keeps: the ``index_topk`` causal keys of highest indexer score
    ``sum_g w_g * relu(q_g . k)`` (all causal keys when there are fewer)."""
    queries = indexer.q.float()[step.token_of]  # [R, Q, G, D]
    weights = indexer.weights.float()[step.token_of]  # [R, Q, G]
    per_head = torch.relu(torch.einsum("rqgd,rsd->rqgs", queries, index_keys))  # [R, Q, G, S]
    scores = torch.einsum("rqg,rqgs->rqs", weights, per_head)
    scores = scores.masked_fill(~step.causal, float("-inf"))  # [R, Q, S]
    num_kept = min(index_topk, scores.shape[-1])
    kept = torch.topk(scores, num_kept, dim=-1).indices  # [R, Q, k]
    keep = torch.zeros_like(step.causal).scatter_(-1, kept, True)
    # With fewer causal keys than index_topk, top-k also picked -inf (non-causal) ones.
    return keep & step.causal


class TorchMLABackend(MLABackend):
    """MLA and DSA over the paged latent cache in dense torch ops: the oracle of every MLA backend.

    ``absorbed=False`` (the default) computes per-head keys and values from the latent, as
    transformers does; ``absorbed=True`` folds ``W_UK`` into the queries and ``W_UV`` into the
    output instead (the constructor's ``absorbed`` flag, else the class attribute). The two
    agree up to rounding.
    """

    name = "mla_torch"
    supported_devices = frozenset({"cpu", "cuda", "xpu"})
    supported_layer_kinds = frozenset({MLA, SPARSE_MLA})

    absorbed = False  # the form of backends the runner builds (it passes no flag)

    def __init__(self, block_size: int, dtype: torch.dtype, device: torch.device, *, absorbed: bool | None = None):
        super().__init__(block_size, dtype, device)
        if absorbed is not None:
            if not isinstance(absorbed, bool):
                raise ValueError(f"absorbed must be a bool, got {absorbed!r}")
            self.absorbed = absorbed

    def forward(
        self,
        layer: MLALayerSpec,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rope applied
        kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank], normalised
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rope applied
        kv_cache: torch.Tensor,  # [num_blocks, block_size, cache_dim]
        metadata: AttentionMetadata,
        w_uk: torch.Tensor,  # [num_heads, qk_nope_head_dim, kv_lora_rank]
        w_uv: torch.Tensor,  # [num_heads, v_head_dim, kv_lora_rank]
        indexer: IndexerInputs | None = None,
        selected: SelectedKeys | None = None,  # keys: the [R, Q, S] mask of keys each query keeps
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        check_forward_inputs(layer, q_nope, q_pe, kv_c, k_pe, kv_cache, w_uk, w_uv, indexer, selected=selected)
        num_tokens = metadata.num_tokens
        store_mla_rows(kv_cache, metadata.slot_mapping[:num_tokens], kv_c[:num_tokens], k_pe[:num_tokens],
                       None if indexer is None else indexer.k[:num_tokens])
        step = pad_step(kv_cache, metadata)
        latent = step.rows[..., : layer.kv_lora_rank]  # [R, S, C]
        rope_keys = step.rows[..., layer.kv_lora_rank: layer.latent_dim]  # [R, S, P]
        visible = step.causal
        if layer.kind == SPARSE_MLA:
            visible = attended_keys(layer, selected, lambda: indexer_keep_mask(
                indexer, step.rows[..., layer.latent_dim:], step, layer.index_topk))

        queries_nope = q_nope.float()[step.token_of]  # [R, Q, H, N]
        queries_pe = q_pe.float()[step.token_of]  # [R, Q, H, P]
        w_uk, w_uv = w_uk.float(), w_uv.float()
        rope_scores = torch.einsum("rqhp,rsp->rhqs", queries_pe, rope_keys)
        if self.absorbed:
            queries_latent = torch.einsum("rqhn,hnc->rqhc", queries_nope, w_uk)  # [R, Q, H, C]
            scores = torch.einsum("rqhc,rsc->rhqs", queries_latent, latent) + rope_scores
        else:
            keys_nope = torch.einsum("rsc,hnc->rshn", latent, w_uk)  # [R, S, H, N]
            scores = torch.einsum("rqhn,rshn->rhqs", queries_nope, keys_nope) + rope_scores
        scores = (scores * layer.scale).masked_fill(~visible.unsqueeze(1), float("-inf"))  # [R, H, Q, S]
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows see no key
        if self.absorbed:
            out_latent = torch.einsum("rhqs,rsc->rqhc", probs, latent)  # [R, Q, H, C]
            out = torch.einsum("rqhc,hvc->rqhv", out_latent, w_uv)
        else:
            values = torch.einsum("rsc,hvc->rshv", latent, w_uv)  # [R, S, H, V]
            out = torch.einsum("rhqs,rshv->rqhv", probs, values)  # [R, Q, H, V]
        return unpad(out, step, q_nope.shape[0], num_tokens).to(q_nope.dtype)


def unpad(out: torch.Tensor, step: PaddedStep, total_tokens: int, num_tokens: int) -> torch.Tensor:
    """``[R, Q, ...]`` back to the flat token order ``[total_tokens, ...]``; rows past
    ``num_tokens`` (padding) are zero."""
    device = out.device
    token_idx = torch.arange(total_tokens, device=device)  # [T]
    num_reqs, max_q = out.shape[:2]
    req_of_token = torch.searchsorted(step.query_start[1:], token_idx, right=True).clamp_max(num_reqs - 1)
    local_idx = (token_idx - step.query_start[req_of_token]).clamp(0, max_q - 1)
    flat = out[req_of_token, local_idx]  # [T, ...]
    is_real = (token_idx < num_tokens).view(-1, *([1] * (flat.dim() - 1)))
    return torch.where(is_real, flat, 0.0)
