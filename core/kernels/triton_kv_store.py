"""Triton KV store: one program per token copies all its heads x head_dim for K and for V.

Strides are passed for every operand, so K and V may be non-contiguous views (slices of a
fused QKV projection, with a token stride wider than ``num_kv_heads * head_dim``) and the
cache may be any strided ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor.
Values are cast to the cache dtype (bf16, fp16 or fp32). Tokens with slot < 0 (padding) are
skipped. The grid is the host-known token count, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, k_stride_token, k_stride_head, k_stride_dim,  # [T, Hkv, D]
    v_ptr, v_stride_token, v_stride_head, v_stride_dim,  # [T, Hkv, D]
    cache_ptr, cache_stride_kv, cache_stride_block, cache_stride_pos, cache_stride_head, cache_stride_dim,
    slot_mapping_ptr,  # [T]
    num_kv_heads, head_dim, block_size,
    BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # 64-bit: token * stride can pass 2**31 elements
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    head = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    dim = tl.arange(0, BLOCK_DIM)[None, :]  # [1, BLOCK_DIM]
    # A padding token (slot < 0) stores no head; written as a bound because the interpreter
    # mis-types a scalar condition combined with a vector mask.
    stored_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (head < stored_heads) & (dim < head_dim)  # [BLOCK_HEADS, BLOCK_DIM]
    k = tl.load(k_ptr + token * k_stride_token + head * k_stride_head + dim * k_stride_dim, mask=mask)
    v = tl.load(v_ptr + token * v_stride_token + head * v_stride_head + dim * v_stride_dim, mask=mask)
    block = slot // block_size
    dst = (block * cache_stride_block + (slot % block_size) * cache_stride_pos
           + head * cache_stride_head + dim * cache_stride_dim)
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + cache_stride_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_heads = triton.next_power_of_2(num_kv_heads)
    block_dim = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, *k.stride(), v, *v.stride(), kv_cache, *kv_cache.stride(), slot_mapping,
        num_kv_heads, head_dim, block_size,
        BLOCK_HEADS=block_heads, BLOCK_DIM=block_dim, num_warps=8 if block_heads * block_dim >= 4096 else 4)
