"""The Triton KV store against the torch version, interpreted on the CPU and compiled on CUDA.

The two differ by design only for padding (slot -1): torch writes it into slot 0 of the
reserved null block, the kernel skips it. So slot 0 is compared separately.
"""

from __future__ import annotations

import pytest
import torch

from helpers_triton import kernels_fixture
from weir.kernels import kv_store
from weir.kernels.dispatch import triton_importable

pytestmark = pytest.mark.skipif(not triton_importable(), reason="Triton is not installed")
kernels = kernels_fixture("triton_kv_store")


def fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, gen):
    """K and V as the attention layer gets them: strided views into one QKV projection."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(device)  # [T, (H+2Hkv)*D]
    k = qkv[:, q_size: q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)  # token stride > Hkv*D
    v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    return k, v


CASES = [  # num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_padding
    (1, 4, 2, 16, 4, 0),
    (9, 4, 4, 32, 4, 3),
    (20, 6, 3, 24, 8, 5),  # head count and head_dim not powers of two
    (33, 8, 1, 64, 16, 2),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_matches_torch(kernels, case, dtype):
    module, device = kernels
    num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_padding = case
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = num_tokens // block_size + 4
    k, v = fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, gen)
    # Distinct slots outside the null block (block 0); the last tokens are padding.
    slots = block_size + torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens]
    slots[num_tokens - num_padding:] = -1
    slots = slots.to(device)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)

    got, want = cache.clone(), cache.clone()
    module.store_kv_triton(got, k, v, slots)
    kv_store.store_kv_torch(want, k, v, slots)
    flat_got = got.view(2, -1, num_kv_heads, head_dim)
    flat_want = want.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat_got[:, 1:], flat_want[:, 1:])
    # Padding never reaches the cache through the kernel.
    assert torch.equal(flat_got[:, 0], cache.view(2, -1, num_kv_heads, head_dim)[:, 0])
    real = slots >= 0
    assert torch.equal(flat_got[0, slots[real]], k[real]) and torch.equal(flat_got[1, slots[real]], v[real])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_store_kv_casts_to_the_cache_dtype(kernels, cache_dtype):
    module, device = kernels
    gen = torch.Generator().manual_seed(0)
    k, v = fused_qkv_views(6, 2, 2, 16, torch.float32, device, gen)
    slots = torch.tensor([4, 5, 6, 9, 12, 15], device=device)
    got = torch.zeros(2, 4, 4, 2, 16, dtype=cache_dtype, device=device)
    want = got.clone()
    module.store_kv_triton(got, k, v, slots)
    kv_store.store_kv_torch(want, k, v, slots)
    if device.type == "cpu" and cache_dtype == torch.bfloat16:
        # Triton's interpreter truncates fp32 -> bf16 where the compiled cast rounds to nearest
        # even (as torch does): allow the last bit there, exact everywhere else.
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
        assert not torch.equal(got, torch.zeros_like(got))
    else:
        assert torch.equal(got, want)


def test_torch_store_sends_padding_to_the_null_slot():
    cache = torch.full((2, 3, 2, 1, 4), 7.0)
    k, v = torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0)
    kv_store.store_kv(cache, k, v, torch.tensor([3, -1]))  # CPU: the torch version
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 1, 1], v[0])
    assert torch.equal(cache[0, 0, 0], k[1]) and torch.equal(cache[1, 0, 0], v[1])
    assert (cache[:, 2] == 7).all()
