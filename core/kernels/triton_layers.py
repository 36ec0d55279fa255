"""Triton kernels for the small per-token layer ops: RMSNorm (+ fused residual add), SiLU-and-mul,
rotary embedding (rotate_half, partial rotary_dim, in place) and per-head q/k RMSNorm fused with
the rotary embedding (Qwen3, Qwen3-Next: one launch instead of three).

The torch versions in ``weir.layers`` (``RMSNorm``, ``GatedMLP``, ``RotaryEmbedding``) are the
oracles. Every kernel rounds where torch rounds: the residual sum and the normalised value are
rounded to the model dtype before the weight multiplies, SiLU is rounded before the gate
product, and each RoPE product is rounded before the difference (fp32 math in between, FMA
contraction off for RoPE), so bf16 results agree with torch up to the last bit of ``rsqrt`` or
``exp``. Grids come from tensor shapes only: every launch is CUDA-graph safe and sync-free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_rows", "num_inner"])
def _rms_norm_kernel(
    x_ptr, x_stride_outer, x_stride_inner,  # rows of x are (outer, inner) pairs; [..., hidden]
    residual_ptr, residual_stride,  # [num_rows, hidden], updated in place when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden], contiguous
    num_rows, num_inner, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]  # [ROWS, BLOCK]
    x_offsets = (rows // num_inner) * x_stride_outer + (rows % num_inner) * x_stride_inner
    x = tl.load(x_ptr + x_offsets[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_offsets = rows[:, None] * residual_stride + cols[None, :]
        residual = tl.load(residual_ptr + residual_offsets, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + residual_offsets, x, mask=mask)
    x_fp32 = x.to(tl.float32)
    variance = tl.math.div_rn(tl.sum(x_fp32 * x_fp32, axis=1), hidden.to(tl.float32))  # [ROWS]
    weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # Qwen3-Next: (1 + w) * x_hat, all in fp32, one rounding at the end
        out = (x_fp32 * tl.math.rsqrt(variance + eps)[:, None]) * (1.0 + weight[None, :])
    else:
        normed = (x_fp32 * tl.math.rsqrt(variance + eps)[:, None]).to(x_ptr.dtype.element_ty)
        out = weight[None, :] * normed.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [num_tokens, hidden] or [num_tokens, num_heads, head_dim]; last stride 1
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden], contiguous rows, x's dtype
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` (``ZeroCenteredRMSNorm.forward`` when ``zero_centered``); with
    ``residual``, ``residual`` becomes ``residual + x`` in place."""
    hidden = x.shape[-1]
    num_inner = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.numel() // hidden
    stride_outer = x.stride(0)
    stride_inner = x.stride(1) if x.dim() == 3 else 0
    out_dtype = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    rows_per_program = max(1, min(64, 4096 // block))
    tile = rows_per_program * block
    _rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x, stride_outer, stride_inner,
        residual if residual is not None else x, residual.stride(0) if residual is not None else 0,
        weight, out, num_rows, num_inner, hidden, eps,
        HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, ROWS=rows_per_program, BLOCK=block,
        num_warps=4 if tile <= 2048 else 8 if tile <= 8192 else 16,
    )
    return out if residual is None else (out, residual)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, gate_up_stride,  # [num_tokens, 2 * intermediate]: gate, then up
    out_ptr,  # [num_tokens, intermediate], contiguous
    intermediate,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < intermediate
    row_ptr = gate_up_ptr + token * gate_up_stride
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu computes x / (1 + exp(-x)) in fp32 and rounds to the tensor's dtype.
    activated = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(out_ptr.dtype.element_ty)
    out = activated.to(tl.float32) * up
    tl.store(out_ptr + token * intermediate + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[..., 2 * intermediate]`` (last stride 1)."""
    intermediate = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, gate_up.shape[-1])  # a view for the linear layer's output
    out = torch.empty(*gate_up.shape[:-1], intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(intermediate, block))](
        rows, rows.stride(0), out, intermediate, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotate_pair(x1, x2, cos, sin, dtype: tl.constexpr):
    """``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` in ``dtype``, from fp32 operands.

    Each product rounds to the dtype before the sum, as torch's ``x1 * cos - x2 * sin`` does on
    dtype tensors (callers launch with FMA contraction off, or the products would not round).
    """
    x1_cos = (x1 * cos).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin).to(dtype).to(tl.float32)
    return (x1_cos - x2_sin).to(dtype), (x2_cos + x1_sin).to(dtype)


@triton.jit
def _rotate_heads(
    head_ptr, stride_head, num_heads, half, cos, sin,  # cos, sin: [BLOCK_HALF] fp32
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """Rotate dims [0, 2 * half) of ``num_heads`` heads of one token in place: pairs ``(i, i + half)``
    (rotate_half), or with ``INTERLEAVED`` pairs ``(2i, 2i + 1)`` written back de-interleaved as
    ``[even' | odd']`` (``InterleavedRotaryEmbedding``). rotate_half stores each element where the
    same thread loaded it; the interleaved layout stores dim ``c`` from the pair another thread
    (possibly another warp) loaded, so a barrier keeps every store after every load of the tile."""
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    for head_start in range(0, num_heads, BLOCK_HEADS):
        heads = head_start + tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
        mask = (heads < num_heads) & (cols < half)
        first_ptr = head_ptr + heads * stride_head + cols
        if INTERLEAVED:
            pair_ptr = head_ptr + heads * stride_head + 2 * cols
            x1 = tl.load(pair_ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF] even dims
            x2 = tl.load(pair_ptr + 1, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF] odd dims
            tl.debug_barrier()
        else:
            x1 = tl.load(first_ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF]
            x2 = tl.load(first_ptr + half, mask=mask, other=0.0).to(tl.float32)
        rotated1, rotated2 = _rotate_pair(x1, x2, cos, sin, head_ptr.dtype.element_ty)
        tl.store(first_ptr, rotated1, mask=mask)
        tl.store(first_ptr + half, rotated2, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr, q_stride_token, q_stride_head,  # [num_tokens, num_q_heads, head_dim]
    k_ptr, k_stride_token, k_stride_head,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr, cache_stride,  # [max_positions, rotary_dim]: cos halves, then sin halves
    num_q_heads, num_kv_heads, half,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos_ptr = cache_ptr + position * cache_stride + cols
    cos = tl.load(cos_ptr, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_ptr + half, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * q_stride_token, q_stride_head, num_q_heads, half, cos, sin,
                  BLOCK_HEADS, BLOCK_HALF, INTERLEAVED)
    _rotate_heads(k_ptr + token * k_stride_token, k_stride_head, num_kv_heads, half, cos, sin,
                  BLOCK_HEADS, BLOCK_HALF, INTERLEAVED)


def rotary_triton(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], last stride 1
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last stride 1
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim], q's dtype
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward`` (``InterleavedRotaryEmbedding.forward`` with ``interleaved``)
    in place on ``q`` and ``k``; returns them."""
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return q, k
    half = cos_sin_cache.shape[-1] // 2
    block_half = triton.next_power_of_2(half)
    block_heads = min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), max(1, 2048 // block_half))
    _rotary_kernel[(num_tokens,)](
        positions, q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1),
        cos_sin_cache, cos_sin_cache.stride(0), q.shape[1], k.shape[1], half,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, INTERLEAVED=interleaved,
        num_warps=4, enable_fp_fusion=False,
    )
    return q, k


@triton.jit
def _normalize_slice(x, inv_rms, weight, dtype: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """Columns of normalised head rows, rounded to ``dtype`` where the torch norm rounds (fp32 out).

    ``x``: [BLOCK_HEADS, N] fp32, ``inv_rms``: [BLOCK_HEADS, 1], ``weight``: [1, N] fp32.
    """
    if ZERO_CENTERED:  # ZeroCenteredRMSNorm: (1 + w) * x_hat all in fp32, one rounding
        out = (x * inv_rms) * (1.0 + weight)
    else:  # RMSNorm: x_hat rounds to the dtype before the weight multiplies
        out = weight * (x * inv_rms).to(dtype).to(tl.float32)
    return out.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["num_q_heads", "num_kv_heads"])
def _qk_norm_rope_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr, q_stride_token, q_stride_head,  # [num_tokens, num_q_heads, head_dim], in place
    k_ptr, k_stride_token, k_stride_head,  # [num_tokens, num_kv_heads, head_dim], in place
    q_weight_ptr, k_weight_ptr,  # [head_dim] each
    cache_ptr, cache_stride,  # [max_positions, rotary_dim]: cos halves, then sin halves
    num_q_heads, num_kv_heads, head_dim, half, eps,
    ZERO_CENTERED: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    # Axis 1 enumerates the q head blocks, then the k head blocks, so one launch covers both.
    num_q_blocks = (num_q_heads + BLOCK_HEADS - 1) // BLOCK_HEADS
    if head_block < num_q_blocks:
        token_ptr = q_ptr + token * q_stride_token
        stride_head = q_stride_head
        weight_ptr = q_weight_ptr
        first_head = head_block * BLOCK_HEADS
        num_heads = num_q_heads
    else:
        token_ptr = k_ptr + token * k_stride_token
        stride_head = k_stride_head
        weight_ptr = k_weight_ptr
        first_head = (head_block - num_q_blocks) * BLOCK_HEADS
        num_heads = num_kv_heads
    dtype = token_ptr.dtype.element_ty

    # A head row is three slices: x1 = [0, half), x2 = [half, 2 * half) (the rotated pairs)
    # and the tail [2 * half, head_dim) that partial rotary passes through.
    heads = first_head + tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    rows_ptr = token_ptr + heads * stride_head  # [BLOCK_HEADS, 1]
    half_cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    tail_cols = 2 * half + tl.arange(0, BLOCK_TAIL)[None, :]  # [1, BLOCK_TAIL]
    half_mask = (heads < num_heads) & (half_cols < half)  # [BLOCK_HEADS, BLOCK_HALF]
    tail_mask = (heads < num_heads) & (tail_cols < head_dim)  # [BLOCK_HEADS, BLOCK_TAIL]
    x1 = tl.load(rows_ptr + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows_ptr + half + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    tail = tl.load(rows_ptr + tail_cols, mask=tail_mask, other=0.0).to(tl.float32)

    sum_squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(tail * tail, axis=1)
    variance = tl.math.div_rn(sum_squares, head_dim.to(tl.float32))  # [BLOCK_HEADS]
    inv_rms = tl.math.rsqrt(variance + eps)[:, None]  # [BLOCK_HEADS, 1]
    weight1 = tl.load(weight_ptr + half_cols, mask=half_cols < half, other=0.0).to(tl.float32)
    weight2 = tl.load(weight_ptr + half + half_cols, mask=half_cols < half, other=0.0).to(tl.float32)
    weight_tail = tl.load(weight_ptr + tail_cols, mask=tail_cols < head_dim, other=0.0).to(tl.float32)
    normed1 = _normalize_slice(x1, inv_rms, weight1, dtype, ZERO_CENTERED)  # [BLOCK_HEADS, BLOCK_HALF]
    normed2 = _normalize_slice(x2, inv_rms, weight2, dtype, ZERO_CENTERED)  # [BLOCK_HEADS, BLOCK_HALF]
    normed_tail = _normalize_slice(tail, inv_rms, weight_tail, dtype, ZERO_CENTERED)  # [BLOCK_HEADS, BLOCK_TAIL]

    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_ptr = cache_ptr + position * cache_stride + half_cols  # [1, BLOCK_HALF]
    cos = tl.load(cos_ptr, mask=half_cols < half, other=0.0).to(tl.float32)
    sin = tl.load(cos_ptr + half, mask=half_cols < half, other=0.0).to(tl.float32)
    rotated1, rotated2 = _rotate_pair(normed1, normed2, cos, sin, dtype)
    tl.store(rows_ptr + half_cols, rotated1, mask=half_mask)
    tl.store(rows_ptr + half + half_cols, rotated2, mask=half_mask)
    tl.store(rows_ptr + tail_cols, normed_tail.to(dtype), mask=tail_mask)


def qk_norm_rope_triton(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], last stride 1
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last stride 1, q's dtype
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim], q_weight's dtype
    eps: float,
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim], q's dtype
    rotary_dim: int,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward(positions, q_norm(q), k_norm(k))`` in one launch, in place on ``q``
    and ``k``; returns them.

    The norms are per head over head_dim: ``RMSNorm`` (``ZeroCenteredRMSNorm`` when
    ``zero_centered``) with weights ``q_weight`` and ``k_weight`` and a shared ``eps``. For
    ``RMSNorm`` the weight's dtype must not promote q's (the result is written into q).
    """
    head_dim = q.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or k.shape[-1] != head_dim or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [num_tokens, heads, head_dim] "
                         "with one head_dim and unit last strides")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,) or q_weight.dtype != k_weight.dtype:
        raise ValueError(f"q/k norm weights {tuple(q_weight.shape)}/{tuple(k_weight.shape)} must both be "
                         f"[{head_dim}] of one dtype")
    if (rotary_dim % 2 or not 0 < rotary_dim <= head_dim or cos_sin_cache.shape[-1] != rotary_dim
            or cos_sin_cache.stride(-1) != 1):
        raise ValueError(f"rotary_dim={rotary_dim} must be even, in (0, head_dim={head_dim}] and match "
                         f"the last dim of the cache {tuple(cos_sin_cache.shape)} (unit stride)")
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return q, k
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    half = rotary_dim // 2
    block_heads = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)),
                      max(1, 1024 // triton.next_power_of_2(head_dim)))
    num_head_blocks = triton.cdiv(num_q_heads, block_heads) + triton.cdiv(num_kv_heads, block_heads)
    _qk_norm_rope_kernel[(num_tokens, num_head_blocks)](
        positions, q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1),
        q_weight.contiguous(), k_weight.contiguous(), cos_sin_cache, cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, head_dim, half, eps,
        ZERO_CENTERED=zero_centered, BLOCK_HEADS=block_heads, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_TAIL=triton.next_power_of_2(max(1, head_dim - rotary_dim)),
        num_warps=4, enable_fp_fusion=False,
    )
    return q, k
