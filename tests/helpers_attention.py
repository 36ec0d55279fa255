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
    sinks: torch.Tensor | None = None  # [num_heads] fp32, when the layer has sinks

    def forward_kwargs(self) -> dict:
        """``sinks=`` only for layers that have them, as the model passes it."""
        return {"sinks": self.sinks} if self.sinks is not None else {}


def first_visible_key(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The first key position any of this step's queries may see (the first query's window)."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - query_len - sliding_window + 1)


def make_case(
    query_lens: list[int], seq_lens: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: str, num_padding_tokens: int = 0, seed: int = 0,
    num_blocks: int | None = None, max_blocks_per_req: int | None = None,
    sliding_window: int | None = None, with_sinks: bool = False, poison: bool = False,
) -> AttentionCase:
    """One step: request r has seq_lens[r] - query_lens[r] cached tokens and query_lens[r] new ones.

    Blocks are handed out in a random order (so pages are not contiguous) and the cache is filled
    with random values, which play the cached prefix. Padding tokens get slot -1.

    ``poison`` plays a KV manager that freed the blocks wholly before each request's window and
    handed them on: those block-table entries name the null block, a spare block or another
    request's block, and every cache slot no query of this step may read holds NaN, so a
    backend that reads any of them (or a key past seq_len) returns NaN.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = num_blocks or 1 + sum(blocks_needed) + 3
    max_blocks_per_req = max_blocks_per_req or max(blocks_needed) + 1
    block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # never the null block
    spare_block = block_ids[0]  # handed out last, if ever: free when the cache has room
    block_tables = torch.zeros(len(seq_lens), max_blocks_per_req, dtype=torch.int32)
    slots, live_slots, handed_out = [], [], []
    for req, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        first_key = first_visible_key(seq_len, query_len, sliding_window) if poison else 0
        freed = first_key // block_size  # blocks wholly before the window
        owned = [block_ids.pop() for _ in range(blocks_needed[req] - freed)]
        reused = handed_out[-1] if handed_out else spare_block  # now another request's block
        table = [(0, spare_block, reused)[b % 3] for b in range(freed)] + owned
        handed_out += owned
        block_tables[req, : len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        live_slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(first_key, seq_len)]
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
                               head_dim=head_dim, scale=head_dim ** -0.5, sliding_window=sliding_window,
                               has_sinks=with_sinks)
    kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    if poison:
        live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        live[torch.tensor(live_slots, dtype=torch.long)] = True
        flat_cache = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat_cache[:, ~live.to(device)] = float("nan")
    sinks = None
    if with_sinks:  # moderate values (they change the output) and one large one (it dominates)
        sinks = torch.randn(num_heads, generator=generator) * 1.5
        sinks[0] = 6.0
        sinks = sinks.to(device)
    return AttentionCase(layer, q, k, v, kv_cache, metadata, sinks)


TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def check_against_reference(backend, case: AttentionCase) -> torch.Tensor:
    """Run ``backend`` and the torch reference on copies of the cache; assert outputs and caches agree."""
    from weir.plugins.attention.torch_ref import TorchAttentionBackend

    block_size = case.kv_cache.shape[2]
    reference = TorchAttentionBackend(block_size, case.q.dtype, case.q.device)
    expected_cache = case.kv_cache.clone()
    expected = reference.forward(case.layer, case.q, case.k, case.v, expected_cache, case.metadata,
                                 **case.forward_kwargs())
    actual_cache = case.kv_cache.clone()
    actual = backend.forward(case.layer, case.q, case.k, case.v, actual_cache, case.metadata,
                             **case.forward_kwargs())
    num_tokens = case.metadata.num_tokens
    tolerance = TOLERANCE[case.q.dtype]
    assert actual.shape == case.q.shape
    assert torch.isfinite(expected[:num_tokens]).all(), "the reference read a slot it must not"
    torch.testing.assert_close(actual[:num_tokens].float(), expected[:num_tokens].float(),
                               atol=tolerance, rtol=tolerance)
    # The reference parks padding tokens in the null block 0; the backend skips them.
    torch.testing.assert_close(actual_cache[:, 1:], expected_cache[:, 1:], atol=0, rtol=0, equal_nan=True)
    assert torch.all(actual[num_tokens:] == 0), "padding rows must be left zero"
    return actual
