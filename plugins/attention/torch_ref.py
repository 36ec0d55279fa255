"""Reference attention over the paged KV cache, in plain torch ops.

It runs on every platform and is the oracle the fast backends are tested against, so it
favours obvious correctness: each request's keys and values are gathered from its blocks into
a padded ``[num_reqs, max_seq_len]`` view and attended with an explicit causal mask.
"""

from __future__ import annotations

import torch

from weir.attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots (``weir.kernels.kv_store``).

    Slot -1 marks padding tokens: the Triton kernel (CUDA) skips them, the torch version writes
    them to slot 0 in the block pool's reserved null block (never handed to a request).
    """
    from weir.kernels.kv_store import store_kv as store_kv_dispatch

    store_kv_dispatch(kv_cache, k, v, slot_mapping)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supported_devices = frozenset({"cpu", "cuda", "xpu"})

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = metadata.num_tokens
        store_kv(kv_cache, k[:num_tokens], v[:num_tokens], metadata.slot_mapping[:num_tokens])

        num_reqs, max_q, max_kv = metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len
        block_size = kv_cache.shape[2]
        device = q.device
        qsl = metadata.query_start_loc[: num_reqs + 1].long()
        seq_lens = metadata.seq_lens[:num_reqs].long()
        query_lens = qsl[1:] - qsl[:-1]  # [R]

        # Gather every request's keys/values into a padded view.
        kv_pos = torch.arange(max_kv, device=device)  # [S]
        max_blocks = (max_kv + block_size - 1) // block_size
        blocks = metadata.block_tables[:num_reqs, :max_blocks].long()  # [R, nb]
        block_of_pos = blocks.gather(1, (kv_pos // block_size).expand(num_reqs, -1))  # [R, S]
        slot_of_pos = block_of_pos * block_size + kv_pos % block_size  # [R, S]
        kv_valid = kv_pos.unsqueeze(0) < seq_lens.unsqueeze(1)  # [R, S]
        slot_of_pos = torch.where(kv_valid, slot_of_pos, torch.zeros_like(slot_of_pos))
        flat_cache = kv_cache.view(2, -1, layer.num_kv_heads, layer.head_dim)
        keys = flat_cache[0][slot_of_pos]  # [R, S, Hkv, D]
        values = flat_cache[1][slot_of_pos]

        # Scatter the flat query tokens into [R, max_q] (query j of request r sits at
        # absolute position seq_len - query_len + j).
        q_idx = torch.arange(max_q, device=device)  # [Q]
        q_valid = q_idx.unsqueeze(0) < query_lens.unsqueeze(1)  # [R, Q]
        token_of = torch.where(q_valid, qsl[:-1].unsqueeze(1) + q_idx, torch.zeros_like(q_valid, dtype=torch.long))
        queries = q[token_of]  # [R, Q, H, D]
        q_pos = (seq_lens - query_lens).unsqueeze(1) + q_idx  # [R, Q]
        mask = (kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)  # [R, Q, S]

        group = layer.num_heads // layer.num_kv_heads
        keys = keys.repeat_interleave(group, dim=2)  # [R, S, H, D]
        values = values.repeat_interleave(group, dim=2)
        scores = torch.einsum("rqhd,rshd->rhqs", queries.float(), keys.float()) * layer.scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
        out = torch.einsum("rhqs,rshd->rqhd", probs, values.float()).to(q.dtype)  # [R, Q, H, D]

        # Back to the flat token order: token t belongs to request r at query index t - qsl[r].
        token_idx = torch.arange(q.shape[0], device=device)  # [T]
        req_of_token = torch.searchsorted(qsl[1:], token_idx, right=True).clamp_max(num_reqs - 1)
        local_idx = (token_idx - qsl[req_of_token]).clamp(0, max_q - 1)
        result = out[req_of_token, local_idx]  # [T, H, D]; rows past num_tokens are padding
        return result
