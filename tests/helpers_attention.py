"""Random paged-attention steps, and the check of a backend against the torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weir.attention import AttentionLayerSpec, AttentionMetadata


@dataclass
class AttentionCase:
    layer: AttentionLayerSpec
    q: torch.Tensor  # [num_tokens + padding, num_heads, head_dim] (a view into one qkv buffer)
    k: torch.Tensor  # [num_tokens + padding, num_kv_heads, head_dim]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]; block 0 = null block
    metadata: AttentionMetadata


def make_case(
    query_lens: list[int], seq_lens: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: str, num_padding_tokens: int = 0, seed: int = 0,
    num_blocks: int | None = None, max_blocks_per_req: int | None = None,
) -> AttentionCase:
    """One step: request r has seq_lens[r] - query_lens[r] cached tokens and query_lens[r] new ones.

    Blocks are handed out in a random order (so pages are not contiguous) and the cache is filled
    with random values, which play the cached prefix. Padding tokens get slot -1.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = num_blocks or 1 + sum(blocks_needed) + 3
    max_blocks_per_req = max_blocks_per_req or max(blocks_needed) + 1
    block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # never the null block
    block_tables = torch.zeros(len(seq_lens), max_blocks_per_req, dtype=torch.int32)
    slots = []
    for req, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        owned = [block_ids.pop() for _ in range(blocks_needed[req])]
        block_tables[req, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(owned[pos // block_size] * block_size + pos % block_size)
    num_tokens = sum(query_lens)
    slot_mapping = torch.tensor(slots + [-1] * num_padding_tokens, dtype=torch.int64)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    total_tokens = num_tokens + num_padding_tokens
    qkv = rand(total_tokens, num_heads + 2 * num_kv_heads, head_dim)  # [T, H + 2 Hkv, D]
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device), slot_mapping=slot_mapping.to(device),
        num_reqs=len(query_lens), num_tokens=num_tokens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )
    layer = AttentionLayerSpec(layer_idx=0, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, scale=head_dim ** -0.5)
    kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    return AttentionCase(layer, q, k, v, kv_cache, metadata)


TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def check_against_reference(backend, case: AttentionCase) -> torch.Tensor:
    """Run ``backend`` and the torch reference on copies of the cache; assert outputs and caches agree."""
    from weir.plugins.attention.torch_ref import TorchAttentionBackend

    block_size = case.kv_cache.shape[2]
    reference = TorchAttentionBackend(block_size, case.q.dtype, case.q.device)
    expected_cache = case.kv_cache.clone()
    expected = reference.forward(case.layer, case.q, case.k, case.v, expected_cache, case.metadata)
    actual_cache = case.kv_cache.clone()
    actual = backend.forward(case.layer, case.q, case.k, case.v, actual_cache, case.metadata)
    num_tokens = case.metadata.num_tokens
    tolerance = TOLERANCE[case.q.dtype]
    assert actual.shape == case.q.shape
    torch.testing.assert_close(actual[:num_tokens].float(), expected[:num_tokens].float(),
                               atol=tolerance, rtol=tolerance)
    # The reference parks padding tokens in the null block 0; the backend skips them.
    torch.testing.assert_close(actual_cache[:, 1:], expected_cache[:, 1:], atol=0, rtol=0)
    assert torch.all(actual[num_tokens:] == 0), "padding rows must be left zero"
    return actual
