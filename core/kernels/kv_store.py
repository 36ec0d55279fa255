"""Writing one step's K/V into the paged KV cache.

Attention backends call ``store_kv``; it runs the Triton kernel (``triton_kv_store``) on CUDA
tensors and ``store_kv_torch`` elsewhere (``weir.kernels.dispatch``). The two differ only for
padding tokens (slot -1): the kernel skips them, the torch version writes them to slot 0,
which lies in the block pool's reserved null block and is never read unmasked.
"""

from __future__ import annotations

import torch

from weir.kernels.dispatch import triton_module, use_triton


def store_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; any strides
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]; any strides
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not stored
) -> None:
    """Write token t's K/V at slot ``slot_mapping[t]`` (block ``slot // block_size``)."""
    if use_triton(kv_cache):
        triton_module("triton_kv_store").store_kv_triton(kv_cache, k, v, slot_mapping)
    else:
        store_kv_torch(kv_cache, k, v, slot_mapping)


def store_kv_torch(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # Clamping sends padding to slot 0 (the null block), so no mask and no device sync is needed.
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, Hkv, D]
    slots = slot_mapping.clamp_min(0)
    flat_cache[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat_cache[1].index_copy_(0, slots, v.to(kv_cache.dtype))
