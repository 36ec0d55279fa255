"""Batch-1 projections of Qwen3-8B: cuBLAS (F.linear) vs Weir's Triton GEMV, per shape and tile.

    python3 -m benchmarks.kernel_bench.bench_gemv

Each case captures a CUDA graph of back-to-back launches that cycle over enough weight copies
to defeat the L2 cache (a real step never re-reads a layer's weights), then times its replays.
Prints microseconds per launch and the weight bandwidth they reach.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from benchmarks.kernel_bench.timing import graph_us
from weir.kernels.triton_gemv import gemv, gemv_tiles

SHAPES = {  # name: (out_features, in_features) of Qwen3-8B
    "qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
    "down_proj": (4096, 12288), "lm_head": (151936, 4096),
}
LAUNCHES = 64


def time_per_launch(fn, copies: list[torch.Tensor], x: torch.Tensor) -> float:
    """Microseconds per ``fn(x, weight)`` launch, the weight cycling over ``copies``."""
    weights = itertools.cycle(copies)
    return graph_us(lambda: fn(x, next(weights)), repeats=LAUNCHES, iters=5)


def main() -> None:
    torch.manual_seed(0)
    print(f"{'shape':<14} {'cuBLAS us':>10} {'TB/s':>6} {'Triton us':>10} {'TB/s':>6}  best tile (default tile us)")
    for name, (out_features, in_features) in SHAPES.items():
        weight_bytes = out_features * in_features * 2
        copies = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
                  for _ in range(max(2, -(-400 * 2**20 // weight_bytes)))]
        x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x, copies[0]).float()
        error = (gemv(x, copies[0]).float() - expected).abs().max().item() / expected.abs().max().item()
        assert error < 2e-2, (name, error)
        cublas = time_per_launch(lambda a, w: F.linear(a, w), copies, x)
        default = gemv_tiles(out_features)
        results = {}
        for tiles in itertools.product((4, 8, 16, 32, 64), (256, 512, 1024), (4, 8)):
            if tiles[0] * tiles[1] > 32768:
                continue
            results[tiles] = time_per_launch(lambda a, w, t=tiles: gemv(a, w, t), copies, x)
        best = min(results, key=results.get)
        print(f"{name:<14} {cublas:>10.2f} {weight_bytes / cublas / 1e6:>6.2f} {results[best]:>10.2f} "
              f"{weight_bytes / results[best] / 1e6:>6.2f}  {best} "
              f"({default}: {results.get(default, float('nan')):.2f})", flush=True)
        del copies


if __name__ == "__main__":
    main()
