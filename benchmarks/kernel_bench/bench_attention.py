"""Microseconds per call of the Triton paged attention backend, with torch SDPA (flash) beside it.

Qwen3-0.6B attention shapes (16 q heads, 8 kv heads, head_dim 128, bf16) on a CUDA device:
decode B=256 at 1024 tokens, decode B=1 at 4096 and 32768 (split-K), prefill of 8192 tokens in
8 requests, and a mixed batch. SDPA runs the same dense shapes (no paging) as a yardstick. Each
Triton time includes the KV store. ``--sweep`` also times other tile configs and split counts.

    python3 -m benchmarks.kernel_bench.bench_attention [--sweep] [--block-size 16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.kernel_bench.timing import graph_us, median_us
from weir.attention import AttentionLayerSpec, AttentionMetadata
from weir.plugins.attention.triton_paged import TileConfig, TritonAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16


def make_step(query_lens: list[int], seq_lens: list[int], block_size: int, device: str = "cuda"):
    """Random q/k/v, a random cache and shuffled block tables (the setup may sync; timing does not)."""
    blocks_per_req = triton.cdiv(max(seq_lens), block_size)
    num_blocks = len(seq_lens) * blocks_per_req + 1
    block_tables = (torch.randperm(num_blocks - 1, device=device) + 1).int().view(len(seq_lens), -1)
    req_of_token = torch.tensor([req for req, ql in enumerate(query_lens) for _ in range(ql)], device=device)
    positions = torch.tensor([pos for ql, s in zip(query_lens, seq_lens) for pos in range(s - ql, s)],
                             device=device)
    slots = block_tables.long()[req_of_token, positions // block_size] * block_size + positions % block_size
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device=device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    num_tokens = sum(query_lens)
    metadata = AttentionMetadata(qsl, seq, block_tables, slots, len(seq_lens), num_tokens,
                                 max(query_lens), max(seq_lens))
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    return q, k, v, cache, metadata


def sdpa_us(batch: int, q_len: int, kv_len: int, causal: bool) -> float:
    q = torch.randn(batch, NUM_HEADS, q_len, HEAD_DIM, dtype=DTYPE, device="cuda")
    k = torch.randn(batch, NUM_KV_HEADS, kv_len, HEAD_DIM, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            run = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            run()
        except (RuntimeError, TypeError):  # flash without native GQA: repeat the kv heads (reads twice the bytes)
            group = NUM_HEADS // NUM_KV_HEADS
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            run = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return median_us(run)


def bench_case(name, query_lens, seq_lens, args, sdpa_shape=None):
    backend = TritonAttentionBackend(args.block_size, DTYPE, torch.device("cuda"))
    layer = AttentionLayerSpec(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    q, k, v, cache, metadata = make_step(query_lens, seq_lens, args.block_size)
    metadata = backend.build_metadata(metadata)
    forward = lambda: backend.forward(layer, q, k, v, cache, metadata)
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    flops = sum(4 * NUM_HEADS * HEAD_DIM * (ql * (s - ql) + ql * (ql + 1) / 2) for ql, s in zip(query_lens, seq_lens))
    eager = median_us(forward)
    line = f"{name:34s} triton {eager:9.1f} us  {kv_bytes / eager / 1e3:7.0f} GB/s  {flops / eager / 1e6:7.1f} TFLOP/s"
    decode = metadata.max_query_len == 1
    if decode:
        splits = backend.num_kv_splits(metadata.num_reqs, NUM_KV_HEADS, metadata.max_seq_len)
        line += f"  graph {graph_us(forward):9.1f} us  splits={splits}"
    if sdpa_shape is not None:
        line += f"  | sdpa-flash {sdpa_us(*sdpa_shape):9.1f} us"
    print(line, flush=True)
    if args.sweep:
        sweep(backend, forward, decode, metadata)


def sweep(backend, forward, decode, metadata):
    if decode:
        for block_n, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4)):
            backend.decode_tiles = TileConfig(16, block_n, warps, stages)
            label = f"    decode tiles n={block_n} warps={warps} stages={stages}"
            try:
                print(f"{label}: {median_us(forward):9.1f} us")
            except Exception as error:
                print(f"{label}: failed ({type(error).__name__})")
        backend.decode_tiles = None
        if metadata.num_reqs * NUM_KV_HEADS < 1024:
            for splits in (1, 4, 8, 16, 32, 48, 64, 96, 128):
                backend.forced_num_splits = splits
                print(f"    splits={splits}: {median_us(forward):9.1f} us")
            backend.forced_num_splits = None
        return
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        backend.prefill_tiles = TileConfig(block_m, block_n, warps, stages)
        label = f"    prefill tiles m={block_m} n={block_n} warps={warps} stages={stages}"
        try:  # some configs need more shared memory or registers than the SM has
            print(f"{label}: {median_us(forward):9.1f} us")
        except Exception as error:
            print(f"{label}: failed ({type(error).__name__})")
    backend.prefill_tiles = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs and split counts")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}  torch {torch.__version__}  "
          f"block_size {args.block_size}  (H={NUM_HEADS}, Hkv={NUM_KV_HEADS}, D={HEAD_DIM}, bf16)")
    bench_case("decode B=256 seq=1024", [1] * 256, [1024] * 256, args, (256, 1, 1024, False))
    bench_case("decode B=1 seq=4096", [1], [4096], args, (1, 1, 4096, False))
    bench_case("decode B=1 seq=32768", [1], [32768], args, (1, 1, 32768, False))
    bench_case("prefill 8 x 1024", [1024] * 8, [1024] * 8, args, (8, 1024, 1024, True))
    bench_case("mixed 255 decode@1024 + 512 chunk", [1] * 255 + [512], [1024] * 255 + [2048], args)


if __name__ == "__main__":
    main()
