"""The Triton paged attention backend against the torch reference backend.

GPU tests (marked ``gpu``) sweep batch kinds, GQA ratios, head dims, block sizes and dtypes.
On the CPU, the same kernels run under ``TRITON_INTERPRET=1`` in a subprocess, because the
variable must be set before triton is first imported and this process may already have done so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from helpers_attention import check_against_reference, make_case

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name -> (query_lens, seq_lens); lengths straddle tile and page edges on purpose.
CASES = {
    "prefill": ([37, 64, 5, 130], [37, 64, 5, 130]),
    "chunked_prefix": ([40, 17, 128, 3], [140, 17 + 300, 128 + 64, 1003]),
    "decode": ([1] * 7, [1, 15, 16, 17, 300, 1000, 2049]),
    "mixed": ([1, 33, 1, 7, 1, 200], [500, 33 + 80, 1, 7, 64, 200 + 31]),
}


def run_case(case_name, *, group, head_dim, block_size, dtype, num_kv_heads=2, padding=3, **overrides):
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    query_lens, seq_lens = CASES[case_name]
    case = make_case(query_lens, seq_lens, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, device="cuda",
                     num_padding_tokens=padding)
    backend = TritonAttentionBackend(block_size, dtype, torch.device("cuda"))
    for name, value in overrides.items():
        setattr(backend, name, value)
    return check_against_reference(backend, case)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("case_name", list(CASES))
def test_matches_reference_bf16(case_name, group, head_dim, block_size):
    run_case(case_name, group=group, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case_name", list(CASES))
def test_matches_reference_other_dtypes(case_name, dtype):
    run_case(case_name, group=4, head_dim=128, block_size=16, dtype=dtype)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("head_dim", "block_size"), [(32, 32), (256, 16), (256, 128), (128, 128)])
def test_other_head_dims_and_block_sizes(head_dim, block_size):
    for case_name in ("mixed", "decode"):
        run_case(case_name, group=2, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 2, 7, 64])
def test_split_k_decode(num_splits):
    out = run_case("decode", group=2, head_dim=128, block_size=16, dtype=torch.bfloat16, num_kv_heads=1,
                   forced_num_splits=num_splits)
    assert torch.isfinite(out).all()


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_small_prefill_tiles(block_m):
    from weir.plugins.attention.triton_paged import TileConfig

    tiles = TileConfig(block_m, 32, 4, 2)
    for case_name in ("chunked_prefix", "mixed"):
        run_case(case_name, group=2, head_dim=64, block_size=16, dtype=torch.float16, prefill_tiles=tiles)


@cuda
@pytest.mark.gpu
def test_forward_makes_no_host_sync():
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    backend = TritonAttentionBackend(16, torch.bfloat16, torch.device("cuda"))
    for case_name in ("mixed", "decode"):
        query_lens, seq_lens = CASES[case_name]
        case = make_case(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                         dtype=torch.bfloat16, device="cuda")
        metadata = backend.build_metadata(case.metadata)
        backend.forward(case.layer, case.q, case.k, case.v, case.kv_cache, metadata)  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.forward(case.layer, case.q, case.k, case.v, case.kv_cache, metadata)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@cuda
@pytest.mark.gpu
def test_decode_graph_replays_with_new_lengths():
    """Capture a padded decode batch once, then replay it on other lengths, blocks and values."""
    from weir.plugins.attention.triton_paged import TritonAttentionBackend

    shape = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda",
                 num_padding_tokens=1, num_blocks=600, max_blocks_per_req=260)
    query_lens = [1] * 7 + [0]  # the last request is graph padding: no token, no keys
    captured = make_case(query_lens, [5, 70, 16, 1, 33, 900, 4000, 0], seed=0, **shape)
    captured.metadata.max_seq_len = 4096  # the capture-time bound decides the number of splits
    backend = TritonAttentionBackend(16, torch.bfloat16, torch.device("cuda"))
    assert backend.num_kv_splits(8, 8, 4096) > 1, "the graph should cover the split-K path"
    static = (captured.layer, captured.q, captured.k, captured.v, captured.kv_cache, captured.metadata)
    backend.forward(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(*static)

    fresh = make_case(query_lens, [4000, 1, 17, 64, 255, 3, 1500, 0], seed=1, **shape)
    for static_tensor, new_tensor in ((captured.q, fresh.q), (captured.k, fresh.k), (captured.v, fresh.v),
                                      (captured.kv_cache, fresh.kv_cache)):
        static_tensor.copy_(new_tensor)
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        getattr(captured.metadata, field).copy_(getattr(fresh.metadata, field))
    expected_cache = fresh.kv_cache.clone()
    expected = check_against_reference(backend, fresh)  # eager result, checked against the reference
    graph.replay()
    torch.testing.assert_close(graph_out[:7], expected[:7], atol=2e-2, rtol=2e-2)
    backend.forward(fresh.layer, fresh.q, fresh.k, fresh.v, expected_cache, fresh.metadata)
    torch.testing.assert_close(captured.kv_cache[:, 1:], expected_cache[:, 1:], atol=0, rtol=0)


# ---- CPU: host-side logic, and the kernels under the Triton interpreter -------------------------

def test_registered_and_default_on_cuda():
    from weir.plugin_manager import load_plugins
    from weir.plugins.attention.triton_paged import TritonAttentionBackend
    from weir.plugins.platforms.cpu import CpuPlatform
    from weir.plugins.platforms.cuda import CudaPlatform

    registry = load_plugins({"builtin_platforms", "builtin_attention"})
    assert registry.resolve_attention_backend("triton") is TritonAttentionBackend
    assert registry.select_attention_backend(CudaPlatform(), {"full_attention"}) is TritonAttentionBackend
    assert registry.select_attention_backend(CpuPlatform(), {"full_attention"}).name == "torch"


def test_split_count_and_head_dim_checks():
    from weir.attention import AttentionLayerSpec
    from weir.plugins.attention.triton_paged import MAX_SPLITS, TritonAttentionBackend

    backend = TritonAttentionBackend(16, torch.float32, torch.device("cpu"))
    backend.num_sms = 132
    assert backend.num_kv_splits(num_reqs=256, num_kv_heads=8, max_seq_len=1024) == 1  # batch fills the GPU
    assert backend.num_kv_splits(num_reqs=1, num_kv_heads=8, max_seq_len=100) == 1  # too short to split
    assert backend.num_kv_splits(num_reqs=1, num_kv_heads=8, max_seq_len=4096) == 16
    assert backend.num_kv_splits(num_reqs=1, num_kv_heads=1, max_seq_len=10 ** 6) == MAX_SPLITS
    layer = AttentionLayerSpec(layer_idx=0, num_heads=4, num_kv_heads=2, head_dim=80, scale=0.1)
    with pytest.raises(ValueError, match="head_dim a power of two.*got 80"):
        backend.kv_cache_shape(10, layer)


def check_tokens_owned_by_no_request(device: str) -> None:
    """A mixed step padded as its graph runs it (requests owning no token, every row a token):
    the real tokens' rows as the reference gives them unpadded, the rest zero, because a MoE
    router reads them next; and the zeroing kernel alone clears exactly those rows of a NaN buffer."""
    from dataclasses import replace

    from weir.plugins.attention.torch_ref import TorchAttentionBackend
    from weir.plugins.attention.triton_paged import TritonAttentionBackend, zero_unowned_rows

    dtype = torch.float32
    case = make_case([1, 5, 3, 6], [9, 12, 3, 30], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                     dtype=dtype, device=device, num_padding_tokens=6)
    real_tokens, rows, padding_reqs = case.metadata.num_tokens, case.q.shape[0], 3
    expected = TorchAttentionBackend(4, dtype, case.q.device).forward(
        case.layer, case.q, case.k, case.v, case.kv_cache.clone(), case.metadata)
    m = case.metadata
    padded = replace(
        m, query_start_loc=torch.cat([m.query_start_loc, m.query_start_loc[-1:].repeat(padding_reqs)]),
        seq_lens=torch.cat([m.seq_lens, m.seq_lens.new_zeros(padding_reqs)]),
        block_tables=torch.cat([m.block_tables, m.block_tables.new_zeros(padding_reqs, m.block_tables.shape[1])]),
        num_reqs=m.num_reqs + padding_reqs, num_tokens=rows, max_query_len=rows - m.num_reqs - padding_reqs + 1,
        max_seq_len=64, has_unowned_tokens=True)
    actual = TritonAttentionBackend(4, dtype, case.q.device).forward(
        case.layer, case.q, case.k, case.v, case.kv_cache.clone(), padded)
    torch.testing.assert_close(actual[:real_tokens], expected[:real_tokens], atol=2e-4, rtol=2e-4)
    assert torch.all(actual[real_tokens:] == 0), "rows of tokens owned by no request must come out zero"
    poisoned = torch.full_like(actual, float("nan"))
    zero_unowned_rows(poisoned, padded)
    assert torch.isnan(poisoned[:real_tokens]).all() and torch.all(poisoned[real_tokens:] == 0)


@cuda
@pytest.mark.gpu
def test_tokens_owned_by_no_request_get_zero_rows_on_cuda():
    check_tokens_owned_by_no_request("cuda")


def interpreted_checks() -> None:
    """Tiny shapes run by the Triton interpreter (called in a subprocess with TRITON_INTERPRET=1)."""
    from weir.plugins.attention.triton_paged import TileConfig, TritonAttentionBackend

    shape = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device="cpu", num_padding_tokens=2)
    # (query_lens, seq_lens, dtype, forced_num_splits, prefill tiles); fp16 numerics, fp32 exactness.
    # bf16 is left to the GPU: the interpreter's bf16 tl.dot is wrong (seen with triton 3.9).
    checks = [
        ([1, 5, 3, 6], [9, 12, 3, 30], torch.float32, None, None),  # mixed: decode + prefix + fresh
        ([1, 1, 1], [7, 21, 1], torch.float16, 3, None),  # split-K decode, one split empty
        ([9, 2], [9, 40], torch.float32, None, TileConfig(16, 16, 4, 1)),  # several query tiles
    ]
    for query_lens, seq_lens, dtype, num_splits, tiles in checks:
        backend = TritonAttentionBackend(4, dtype, torch.device("cpu"))
        backend.forced_num_splits, backend.prefill_tiles = num_splits, tiles
        check_against_reference(backend, make_case(query_lens, seq_lens, dtype=dtype, **shape))
    check_tokens_owned_by_no_request("cpu")


@pytest.mark.integration  # the interpreter, in a subprocess: seconds
def test_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    started = time.monotonic()
    result = subprocess.run([sys.executable, __file__, "--interpreted-checks"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreted checks passed" in result.stdout
    assert time.monotonic() - started < 60


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted-checks"]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    interpreted_checks()
    print("interpreted checks passed")
