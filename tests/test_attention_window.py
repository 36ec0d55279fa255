"""Sliding windows and attention sinks: the torch reference against a dense computation, and the
Triton paged backend against the reference (interpreted on the CPU, compiled on CUDA).

The window follows transformers: the query at position p sees keys p - W + 1 .. p. A sink is
one extra logit per head in the softmax denominator with a zero value row. Most cases are
"poisoned" (``make_case(poison=True)``): the blocks wholly before a request's window are
stale entries of the block table and every slot no query may read holds NaN, so a backend
that reads outside the window returns NaN and fails.
"""

from __future__ import annotations

import pytest
import torch

from helpers_attention import check_against_reference, first_visible_key, make_case
from helpers_triton import kernel_check_tests
from weir.plugins.attention.torch_ref import TorchAttentionBackend


def dense_attention(case) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float64
    """Request by request in float64: every key position of the sequence, a materialised
    [query_len, seq_len] mask (causal and windowed), and the sinks as a last softmax column."""
    layer, metadata = case.layer, case.metadata
    block_size = case.kv_cache.shape[2]
    group = layer.num_heads // layer.num_kv_heads
    window = layer.sliding_window
    qsl = metadata.query_start_loc.tolist()
    outputs = []
    for req, seq_len in enumerate(metadata.seq_lens.tolist()):
        begin, end = qsl[req], qsl[req + 1]
        query_len = end - begin
        context_len = seq_len - query_len
        first_key = first_visible_key(seq_len, query_len, window)
        keys = torch.zeros(seq_len, layer.num_kv_heads, layer.head_dim, dtype=torch.float64)
        values = torch.zeros_like(keys)
        for pos in range(first_key, context_len):  # the cached prefix that some query may see
            block = int(metadata.block_tables[req, pos // block_size])
            keys[pos] = case.kv_cache[0, block, pos % block_size].double().cpu()
            values[pos] = case.kv_cache[1, block, pos % block_size].double().cpu()
        keys[context_len:] = case.k[begin:end].double().cpu()
        values[context_len:] = case.v[begin:end].double().cpu()
        query_pos = torch.arange(context_len, seq_len).unsqueeze(1)  # [Q, 1]
        key_pos = torch.arange(seq_len).unsqueeze(0)  # [1, S]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        queries = case.q[begin:end].double().cpu()  # [Q, H, D]
        keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", queries, keys) * layer.scale
        scores = scores.masked_fill(~visible, float("-inf"))  # [H, Q, S]
        if case.sinks is not None:
            sink_column = case.sinks.double().cpu().view(-1, 1, 1).expand(-1, query_len, 1)
            scores = torch.cat([scores, sink_column], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :seq_len]
        outputs.append(torch.einsum("hqs,shd->qhd", probs, values))
    return torch.cat(outputs)


SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device="cpu", num_padding_tokens=2)
# (query_lens, seq_lens): fresh varlen prefill, a cached prefix longer than the window, mixed
# prefill + decode, pure decode; lengths straddle blocks.
BATCHES = {
    "prefill": ([9, 2, 13], [9, 2, 13]),
    "chunked_prefix": ([5, 3], [30, 19]),
    "mixed": ([1, 5, 1, 6, 1], [20, 12, 3, 30, 1]),
    "decode": ([1, 1, 1, 1], [1, 9, 17, 40]),
}
# Below a block, equal to it, just above it, W=1, longer than every sequence, and none.
WINDOWS = [3, 4, 5, 1, 100, None]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda window: f"W{window}")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_reference_matches_dense_attention(batch, window, with_sinks):
    query_lens, seq_lens = BATCHES[batch]
    case = make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=window, with_sinks=with_sinks,
                     poison=True, **SHAPE)
    backend = TorchAttentionBackend(4, torch.float32, torch.device("cpu"))
    out = backend.forward(case.layer, case.q, case.k, case.v, case.kv_cache, case.metadata,
                          **case.forward_kwargs())
    num_tokens = case.metadata.num_tokens
    torch.testing.assert_close(out[:num_tokens].double(), dense_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense_attention_gqa_groups(group):
    query_lens, seq_lens = BATCHES["mixed"]
    shape = dict(SHAPE, num_heads=2 * group)
    case = make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=5, with_sinks=True, poison=True,
                     **shape)
    backend = TorchAttentionBackend(4, torch.float32, torch.device("cpu"))
    out = backend.forward(case.layer, case.q, case.k, case.v, case.kv_cache, case.metadata, sinks=case.sinks)
    torch.testing.assert_close(out[: case.metadata.num_tokens].double(), dense_attention(case), atol=1e-5,
                               rtol=1e-5)


def test_poisoned_cases_catch_reads_outside_the_window():
    """The same poisoned step attended without its window reads freed blocks: NaN comes out."""
    import dataclasses

    query_lens, seq_lens = BATCHES["chunked_prefix"]
    case = make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=3, poison=True, **SHAPE)
    assert case.metadata.block_tables[0, 0] == 0, "the first block of request 0 should be freed"
    backend = TorchAttentionBackend(4, torch.float32, torch.device("cpu"))
    full_layer = dataclasses.replace(case.layer, sliding_window=None)
    out = backend.forward(full_layer, case.q, case.k, case.v, case.kv_cache.clone(), case.metadata)
    assert torch.isnan(out[: case.metadata.num_tokens]).any()


def test_sinks_and_window_change_the_result():
    """Guards the dense oracle itself: neither feature may be a silent no-op."""
    query_lens, seq_lens = BATCHES["chunked_prefix"]
    plain = dense_attention(make_case(query_lens, seq_lens, dtype=torch.float32, **SHAPE))
    windowed = dense_attention(make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=5, **SHAPE))
    with_sinks = dense_attention(make_case(query_lens, seq_lens, dtype=torch.float32, with_sinks=True, **SHAPE))
    assert (plain - windowed).abs().max() > 0.1
    assert (plain - with_sinks).abs().max() > 0.1


def test_reference_refuses_mismatched_sinks():
    backend = TorchAttentionBackend(4, torch.float32, torch.device("cpu"))
    query_lens, seq_lens = BATCHES["decode"]
    with_sinks = make_case(query_lens, seq_lens, dtype=torch.float32, with_sinks=True, **SHAPE)
    without = make_case(query_lens, seq_lens, dtype=torch.float32, **SHAPE)
    with pytest.raises(ValueError, match="has sinks but forward got sinks=None"):
        backend.forward(with_sinks.layer, with_sinks.q, with_sinks.k, with_sinks.v, with_sinks.kv_cache,
                        with_sinks.metadata)
    with pytest.raises(ValueError, match="declares no sinks"):
        backend.forward(without.layer, without.q, without.k, without.v, without.kv_cache, without.metadata,
                        sinks=with_sinks.sinks)
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\]=\(4,\), got \(2,\)"):
        backend.forward(with_sinks.layer, with_sinks.q, with_sinks.k, with_sinks.v, with_sinks.kv_cache,
                        with_sinks.metadata, sinks=with_sinks.sinks[:2])


def test_backends_declare_windows_and_sinks():
    from weir.attention import FULL_ATTENTION, SLIDING_ATTENTION
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    for backend_cls in (TorchAttentionBackend, TritonAttentionBackend):
        assert backend_cls.supported_layer_kinds >= {FULL_ATTENTION, SLIDING_ATTENTION}
        assert backend_cls.supports_sinks


def test_decode_splits_and_warmup_follow_the_window():
    """Split-K divides the window, not the sequence; warm-up names one decode shape per split class."""
    from weir.attention import AttentionLayerSpec
    from weir.plugins.attention.triton_paged import TritonAttentionBackend, keys_read

    backend = TritonAttentionBackend(16, torch.bfloat16, torch.device("cpu"))
    backend.num_sms = 132
    full = AttentionLayerSpec(layer_idx=0, num_heads=8, num_kv_heads=1, head_dim=128, scale=0.1)
    sliding = AttentionLayerSpec(layer_idx=1, num_heads=8, num_kv_heads=1, head_dim=128, scale=0.1,
                                 sliding_window=128, has_sinks=True)
    assert keys_read(full, 8192) == 8192 and keys_read(sliding, 8192) == 128 and keys_read(sliding, 100) == 100
    assert backend.num_kv_splits(1, 1, keys_read(full, 8192)) == 32
    assert backend.num_kv_splits(1, 1, keys_read(sliding, 8192)) == 1  # 128 keys: not worth splitting
    decode_shapes = [shape for shape in backend.warmup_shapes(sliding, 64, [1, 64, 256], 8192)
                     if max(shape[0]) == 1]
    assert len(decode_shapes) == 1, "a 128-key window never splits: one decode variant"
    assert len([shape for shape in backend.warmup_shapes(full, 64, [1, 64, 256], 8192)
                if max(shape[0]) == 1]) > 1


def test_triton_refuses_mismatched_sinks():
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    backend = TritonAttentionBackend(4, torch.float32, torch.device("cpu"))
    query_lens, seq_lens = BATCHES["decode"]
    case = make_case(query_lens, seq_lens, dtype=torch.float32, with_sinks=True, **SHAPE)
    with pytest.raises(ValueError, match="has sinks but forward got sinks=None"):
        backend.forward(case.layer, case.q, case.k, case.v, case.kv_cache, case.metadata)
    with pytest.raises(ValueError, match="sinks must be a contiguous tensor"):
        strided = torch.zeros(8)[::2]
        backend.forward(case.layer, case.q, case.k, case.v, case.kv_cache, case.metadata, sinks=strided)


# ---- the Triton kernels against the reference: interpreted on the CPU, compiled on CUDA ----------

def triton_backend(dtype, device, block_size, *, splits=None, prefill_tiles=None, decode_block_n=None):
    from weir.plugins.attention.triton_paged import TileConfig, TritonAttentionBackend

    backend = TritonAttentionBackend(block_size, dtype, torch.device(device))
    backend.forced_num_splits, backend.prefill_tiles = splits, prefill_tiles
    if decode_block_n is not None:  # short key tiles, so a small window spans several of them
        backend.decode_tiles = TileConfig(16, decode_block_n, 4, 1)
    return backend


def sixteen_bit(device: str) -> list[torch.dtype]:
    # The interpreter's bf16 tl.dot is wrong (seen with triton 3.9): bf16 is checked on CUDA only.
    return [torch.float16] if device == "cpu" else [torch.float16, torch.bfloat16]


def check_windows_on_every_batch_kind(device: str) -> None:
    """Each batch kind and window size (below, at and above a block, W=1, past the sequence)."""
    for batch, (query_lens, seq_lens) in BATCHES.items():
        for window in (3, 4, 1, 100):
            case = make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=window, poison=True,
                             **dict(SHAPE, device=device))
            check_against_reference(triton_backend(torch.float32, device, 4), case)


def check_sinks_alone_and_with_windows(device: str) -> None:
    for batch in ("chunked_prefix", "mixed", "decode"):
        query_lens, seq_lens = BATCHES[batch]
        for window in (None, 5):
            case = make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=window, with_sinks=True,
                             poison=True, **dict(SHAPE, device=device))
            check_against_reference(triton_backend(torch.float32, device, 4), case)


def check_split_k_divides_the_window(device: str) -> None:
    """Pure decode with split-K over a window of several key tiles (some splits empty), with and
    without sinks (added once, in the reduce)."""
    query_lens, seq_lens = [1, 1, 1, 1], [3, 40, 77, 130]
    for window, splits, with_sinks in ((40, 3, False), (40, 3, True), (33, 5, True), (6, 2, True), (40, 1, True)):
        case = make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=window, with_sinks=with_sinks,
                         poison=True, **dict(SHAPE, device=device))
        check_against_reference(triton_backend(torch.float32, device, 4, splits=splits, decode_block_n=16), case)


def check_prefill_tiles_inside_and_across_the_window(device: str) -> None:
    """Several query tiles per request, with key tiles before the window (skipped), across its
    start (masked per row), wholly inside it (unmasked) and across the diagonal."""
    from weir.plugins.attention.triton_paged import TileConfig

    tiles = TileConfig(16, 16, 4, 1)  # 8 query tokens x 2 heads per tile, 16 keys per tile
    query_lens, seq_lens = [20, 1, 37], [100, 50, 37]
    for window, with_sinks in ((40, False), (40, True), (9, True), (17, False)):
        case = make_case(query_lens, seq_lens, dtype=torch.float32, sliding_window=window, with_sinks=with_sinks,
                         poison=True, **dict(SHAPE, device=device))
        check_against_reference(triton_backend(torch.float32, device, 4, prefill_tiles=tiles, decode_block_n=16),
                                case)


def check_gqa_groups_and_sixteen_bit(device: str) -> None:
    for group in (1, 3, 4):  # 3: padded head rows in both kernels
        for dtype in sixteen_bit(device):
            query_lens, seq_lens = BATCHES["mixed"]
            case = make_case(query_lens, seq_lens, dtype=dtype, sliding_window=5, with_sinks=True, poison=True,
                             **dict(SHAPE, num_heads=2 * group, device=device))
            check_against_reference(triton_backend(dtype, device, 4), case)
            decode = make_case([1, 1, 1], [9, 40, 2], dtype=dtype, sliding_window=20, with_sinks=True, poison=True,
                               **dict(SHAPE, num_heads=2 * group, device=device))
            check_against_reference(triton_backend(dtype, device, 4, splits=2, decode_block_n=16), decode)


def check_full_attention_ignores_stale_slots(device: str) -> None:
    """Without a window every block is live, but slots past seq_len and spare blocks hold NaN."""
    for batch in ("chunked_prefix", "mixed"):
        query_lens, seq_lens = BATCHES[batch]
        case = make_case(query_lens, seq_lens, dtype=torch.float32, poison=True, **dict(SHAPE, device=device))
        check_against_reference(triton_backend(torch.float32, device, 4), case)


CHECKS = [check_windows_on_every_batch_kind, check_sinks_alone_and_with_windows, check_split_k_divides_the_window,
          check_prefill_tiles_inside_and_across_the_window, check_gqa_groups_and_sixteen_bit,
          check_full_attention_ignores_stale_slots]

test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_attention_window", CHECKS)


# ---- GPU only: realistic shapes (Granite SWA: head_dim 128, 5 q heads per kv head, W=128) --------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# name -> (query_lens, seq_lens): long prompts, chunks after a prefix far past the window, mixed, decode.
GPU_BATCHES = {
    "prefill": ([300, 64, 5, 1030], [300, 64, 5, 1030]),
    "chunked_prefix": ([40, 17, 128, 3], [140, 17 + 300, 128 + 64, 1003]),
    "mixed": ([1, 33, 1, 7, 1, 200], [500, 33 + 80, 1, 7, 64, 200 + 31]),
    "decode": ([1] * 7, [1, 15, 16, 17, 300, 1000, 2049]),
}


def run_gpu_case(batch, *, window, with_sinks, group, head_dim=128, block_size=16, dtype=torch.bfloat16,
                 num_kv_heads=2, **overrides):
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    query_lens, seq_lens = GPU_BATCHES[batch]
    case = make_case(query_lens, seq_lens, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, device="cuda", num_padding_tokens=3,
                     sliding_window=window, with_sinks=with_sinks, poison=True)
    backend = TritonAttentionBackend(block_size, dtype, torch.device("cuda"))
    for name, value in overrides.items():
        setattr(backend, name, value)
    return check_against_reference(backend, case)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 5])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("window", [1, 16, 100, 128, 4096, None], ids=lambda window: f"W{window}")
@pytest.mark.parametrize("batch", list(GPU_BATCHES))
def test_gpu_windows_and_sinks_bf16(batch, window, with_sinks, group):
    run_gpu_case(batch, window=window, with_sinks=with_sinks, group=group)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 64), (128, 16), (256, 16)])
@pytest.mark.parametrize("batch", ["chunked_prefix", "mixed", "decode"])
def test_gpu_other_shapes_and_dtypes(batch, head_dim, block_size, dtype):
    run_gpu_case(batch, window=100, with_sinks=True, group=4, head_dim=head_dim, block_size=block_size, dtype=dtype)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 2, 7, 64])
@pytest.mark.parametrize("window", [128, 1000])
def test_gpu_split_k_over_the_window(window, num_splits):
    run_gpu_case("decode", window=window, with_sinks=True, group=5, num_kv_heads=1, forced_num_splits=num_splits)


@cuda
@pytest.mark.gpu
def test_gpu_forward_makes_no_host_sync_with_windows_and_sinks():
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    backend = TritonAttentionBackend(16, torch.bfloat16, torch.device("cuda"))
    for batch in ("mixed", "decode"):
        query_lens, seq_lens = GPU_BATCHES[batch]
        case = make_case(query_lens, seq_lens, num_heads=10, num_kv_heads=2, head_dim=128, block_size=16,
                         dtype=torch.bfloat16, device="cuda", sliding_window=128, with_sinks=True)
        args = (case.layer, case.q, case.k, case.v, case.kv_cache, case.metadata)
        backend.forward(*args, sinks=case.sinks)  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.forward(*args, sinks=case.sinks)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@cuda
@pytest.mark.gpu
def test_gpu_windowed_decode_graph_replays_with_new_lengths():
    """Capture a padded split-K decode of a windowed layer with sinks, then replay it on other
    lengths and block tables whose out-of-window entries are stale."""
    from weir.plugins.attention.triton_paged import TritonAttentionBackend, keys_read

    shape = dict(num_heads=40, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda",
                 num_padding_tokens=1, num_blocks=700, max_blocks_per_req=260, sliding_window=1000,
                 with_sinks=True, poison=True)
    query_lens = [1] * 7 + [0]  # the last request is graph padding: no token, no keys
    captured = make_case(query_lens, [5, 70, 16, 1, 33, 900, 4000, 0], seed=0, **shape)
    captured.metadata.max_seq_len = 4096  # the capture-time bound decides the number of splits
    backend = TritonAttentionBackend(16, torch.bfloat16, torch.device("cuda"))
    assert backend.num_kv_splits(8, 8, keys_read(captured.layer, 4096)) > 1, "the graph should cover split-K"
    static = (captured.layer, captured.q, captured.k, captured.v, captured.kv_cache, captured.metadata)
    backend.forward(*static, sinks=captured.sinks)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(*static, sinks=captured.sinks)

    fresh = make_case(query_lens, [4000, 1, 17, 64, 2555, 3, 1500, 0], seed=1, **shape)
    for static_tensor, new_tensor in ((captured.q, fresh.q), (captured.k, fresh.k), (captured.v, fresh.v),
                                      (captured.kv_cache, fresh.kv_cache), (captured.sinks, fresh.sinks)):
        static_tensor.copy_(new_tensor)
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        getattr(captured.metadata, field).copy_(getattr(fresh.metadata, field))
    expected = check_against_reference(backend, fresh)  # eager result, checked against the reference
    graph.replay()
    torch.testing.assert_close(graph_out[:7], expected[:7], atol=2e-2, rtol=2e-2)
