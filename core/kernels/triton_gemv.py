"""Skinny GEMM for decode batches of a few rows: ``y[M, N] = x[M, K] @ W[N, K]^T``.

At batch 1 a decode step only streams weights, and cuBLAS picks split-K kernels for some
shapes whose partial sums cost a second launch (a reduce kernel) per projection. This kernel
gives each program ``BLOCK_N`` whole output columns: it streams their ``BLOCK_N x K`` weight
rows once, keeps a ``[BLOCK_N, BLOCK_K]`` fp32 partial product in registers, and reduces it
over K only at the end, so one launch writes the final outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, num_rows, out_features, in_features,
    stride_xm, stride_wn, stride_ym,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    col_mask = cols < out_features
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    for row in tl.static_range(ROWS):
        if row < num_rows:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, in_features, BLOCK_K):
                k = k0 + ks
                if EVEN_K:
                    w = tl.load(w_rows + k[None, :], mask=col_mask[:, None], other=0.0)  # [BN, BK]
                    x = tl.load(x_ptr + row * stride_xm + k)  # [BK]
                else:
                    k_mask = k < in_features
                    w = tl.load(w_rows + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
                    x = tl.load(x_ptr + row * stride_xm + k, mask=k_mask, other=0.0)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            out = tl.sum(acc, axis=1)  # [BN]
            tl.store(y_ptr + row * stride_ym + cols, out.to(y_ptr.dtype.element_ty), mask=col_mask)


def gemv_tiles(out_features: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep of Qwen3-8B's projections on an H200
    (``benchmarks/kernel_bench/bench_gemv.py``): 16 rows x 1024 for up to 16k outputs, 32 x 256 for wider ones."""
    if out_features <= 16384:
        return 16, 1024, 8
    return 32, 256, 8


def gemv(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T`` (no bias; M of a few rows, each re-streams the weight;
    ``weight`` rows contiguous); returns [M, N] in x's dtype, accumulated in fp32."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if weight.stride(-1) != 1:
        raise ValueError(f"gemv needs weight rows contiguous, got strides {tuple(weight.stride())}")
    if weight.shape[1] != in_features or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match weight {tuple(weight.shape)} {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = tiles or gemv_tiles(out_features)
    _gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, y, num_rows, out_features, in_features, x.stride(0), weight.stride(0), y.stride(0),
        ROWS=max(1, num_rows), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=in_features % block_k == 0,
        num_warps=num_warps,
    )
    return y
