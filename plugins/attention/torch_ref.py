"""Reference attention over the paged KV cache, in plain torch ops.

It runs on every platform and is the oracle the fast backends are tested against, so it
favours obvious correctness: each request's keys and values are gathered from its blocks into
a padded ``[num_reqs, max_seq_len]`` view and attended with an explicit mask (causal, and
within the layer's sliding window when it has one), with the layer's sinks as one extra
softmax column whose value row is zero.

Keys before a request's window are never used: their block-table entries may name blocks
already freed and handed to another request (or the null block), so the gather reads only
in-window entries and zeroes every masked key and value before any arithmetic.
"""

from __future__ import annotations

import torch

from weir.attention import (FULL_ATTENTION, SLIDING_ATTENTION, AttentionBackend, AttentionLayerSpec,
                            AttentionMetadata)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into their slots (``weir.kernels.kv_store``).

    Slot -1 marks padding tokens: the Triton kernel (CUDA) skips them, the torch version writes
    them to slot 0 in the block pool's reserved null block (never handed to a request).
    """
    from weir.kernels.kv_store import store_kv as store_kv_dispatch

    store_kv_dispatch(kv_cache, k, v, slot_mapping)


def check_sinks(layer: AttentionLayerSpec, sinks: torch.Tensor | None) -> None:
    """Refuse sinks a layer does not declare, missing sinks it does, and a wrong shape."""
    if layer.has_sinks and sinks is None:
        raise ValueError(f"layer {layer.layer_idx} has sinks but forward got sinks=None")
    if not layer.has_sinks and sinks is not None:
        raise ValueError(f"layer {layer.layer_idx} declares no sinks (has_sinks=False) but forward got sinks")
    if sinks is not None and tuple(sinks.shape) != (layer.num_heads,):
        raise ValueError(f"layer {layer.layer_idx}: sinks must have shape [num_heads]=({layer.num_heads},), "
                         f"got {tuple(sinks.shape)}")


class TorchAttentionBackend(AttentionBackend):
    """Full and sliding-window attention, with or without sinks, in dense torch ops."""

    name = "torch"
    supported_devices = frozenset({"cpu", "cuda", "xpu"})
    supported_layer_kinds = frozenset({FULL_ATTENTION, SLIDING_ATTENTION})
    supports_sinks = True

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32
    ) -> torch.Tensor:
        check_sinks(layer, sinks)
        num_tokens = metadata.num_tokens
        store_kv(kv_cache, k[:num_tokens], v[:num_tokens], metadata.slot_mapping[:num_tokens])

        num_reqs, max_q, max_kv = metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len
        block_size = kv_cache.shape[2]
        device = q.device
        qsl = metadata.query_start_loc[: num_reqs + 1].long()
        seq_lens = metadata.seq_lens[:num_reqs].long()
        query_lens = qsl[1:] - qsl[:-1]  # [R]
        context_lens = seq_lens - query_lens  # [R]
        window = layer.sliding_window

        # The first key any query of the request may see: the first query's window start.
        first_key = torch.zeros_like(seq_lens)  # [R]
        if window is not None:
            first_key = (context_lens - window + 1).clamp_min(0)

        # Gather every request's visible key range into a padded view. Positions outside it read
        # an in-range, in-window table entry (clamped), and their keys/values are zeroed below.
        kv_pos = torch.arange(max_kv, device=device)  # [S]
        kv_valid = (kv_pos.unsqueeze(0) < seq_lens.unsqueeze(1)) & (kv_pos.unsqueeze(0) >= first_key.unsqueeze(1))
        last_key = (seq_lens - 1).clamp_min(0)
        read_pos = torch.minimum(torch.maximum(kv_pos.unsqueeze(0), first_key.unsqueeze(1)),
                                 last_key.unsqueeze(1))  # [R, S]
        max_blocks = (max_kv + block_size - 1) // block_size
        blocks = metadata.block_tables[:num_reqs, :max_blocks].long()  # [R, nb]
        block_of_pos = blocks.gather(1, read_pos // block_size)  # [R, S]
        slot_of_pos = block_of_pos * block_size + read_pos % block_size  # [R, S]
        slot_of_pos = torch.where(kv_valid, slot_of_pos, torch.zeros_like(slot_of_pos))
        flat_cache = kv_cache.view(2, -1, layer.num_kv_heads, layer.head_dim)
        # where, not a multiply: a masked slot may hold NaN (the null block, a reused block's tail).
        keep = kv_valid[:, :, None, None]
        keys = torch.where(keep, flat_cache[0][slot_of_pos], 0.0)  # [R, S, Hkv, D]
        values = torch.where(keep, flat_cache[1][slot_of_pos], 0.0)

        # Scatter the flat query tokens into [R, max_q] (query j of request r sits at
        # absolute position seq_len - query_len + j).
        q_idx = torch.arange(max_q, device=device)  # [Q]
        q_valid = q_idx.unsqueeze(0) < query_lens.unsqueeze(1)  # [R, Q]
        token_of = torch.where(q_valid, qsl[:-1].unsqueeze(1) + q_idx, torch.zeros_like(q_valid, dtype=torch.long))
        queries = q[token_of]  # [R, Q, H, D]
        q_pos = context_lens.unsqueeze(1) + q_idx  # [R, Q]
        mask = (kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)  # [R, Q, S]
        if window is not None:
            mask &= kv_pos.view(1, 1, -1) > q_pos.unsqueeze(-1) - window

        group = layer.num_heads // layer.num_kv_heads
        keys = keys.repeat_interleave(group, dim=2)  # [R, S, H, D]
        values = values.repeat_interleave(group, dim=2)
        scores = torch.einsum("rqhd,rshd->rhqs", queries.float(), keys.float()) * layer.scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))  # [R, H, Q, S]
        if sinks is not None:
            sink_column = sinks.float().view(1, -1, 1, 1).expand(num_reqs, -1, max_q, 1)  # [R, H, Q, 1]
            scores = torch.cat([scores, sink_column], dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are all -inf
        probs = probs[..., :max_kv]  # the sink's value row is zero: drop its column
        out = torch.einsum("rhqs,rshd->rqhd", probs, values.float()).to(q.dtype)  # [R, Q, H, D]

        # Back to the flat token order: token t belongs to request r at query index t - qsl[r].
        token_idx = torch.arange(q.shape[0], device=device)  # [T]
        req_of_token = torch.searchsorted(qsl[1:], token_idx, right=True).clamp_max(num_reqs - 1)
        local_idx = (token_idx - qsl[req_of_token]).clamp(0, max_q - 1)
        result = out[req_of_token, local_idx]  # [T, H, D]; rows past num_tokens are padding
        return result
