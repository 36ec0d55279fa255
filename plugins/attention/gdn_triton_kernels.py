"""Weir's Triton decode kernels for Gated DeltaNet layers: one token per request, in place on the
slot-indexed state pools (``weir.linear_attention``).

fla's decode kernels keep states in batch order, so a pooled state would need a gather and a
scatter of ``[HV, Dk, Dv]`` fp32 per request per layer; these kernels read and write each
request's slot directly. Grids depend only on the batch size and the layer shapes and nothing is
read on the host, so every launch can be captured in a CUDA graph. CUDA-graph padding requests
all point at the padding slot: their programs race on it, which only scrambles that unused slot.

The launchers take their output tensors from the caller, so this module needs no torch ops.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv_decode_kernel(
    x_ptr, stride_x,  # [B, D]: this step's pre-conv channels
    conv_state_ptr, stride_cs_slot, stride_cs_chan,  # [S, D, K], oldest tap first, taps contiguous
    weight_ptr, stride_w,  # [D, K], taps contiguous
    state_indices_ptr,  # [B] int32: each request's slot
    out_ptr, stride_out,  # [B, D]
    dim,
    KERNEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Shift x into the request's conv window and write SiLU(window . weight) per channel."""
    req = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    taps = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    channel_mask = channels < dim
    slot = tl.load(state_indices_ptr + req).to(tl.int64)
    state_rows = conv_state_ptr + slot * stride_cs_slot + channels[:, None].to(tl.int64) * stride_cs_chan

    # The window after this token: the old taps 1..K-1 moved one step older, then x as the newest.
    shifted = tl.load(state_rows + taps[None, :] + 1, mask=channel_mask[:, None] & (taps[None, :] + 1 < KERNEL),
                      other=0.0)  # [BLOCK_D, BLOCK_K]
    x = tl.load(x_ptr + req.to(tl.int64) * stride_x + channels, mask=channel_mask, other=0.0)  # [BLOCK_D]
    newest = x[:, None].to(conv_state_ptr.dtype.element_ty)  # [BLOCK_D, 1]
    window = tl.where(taps[None, :] == KERNEL - 1, newest, shifted)  # [BLOCK_D, BLOCK_K]
    # Tap j is read by one thread and rewritten (from tap j + 1) by another: every read must land
    # before any write of this program.
    tl.debug_barrier()
    tl.store(state_rows + taps[None, :], window, mask=channel_mask[:, None] & (taps[None, :] < KERNEL))

    weight = tl.load(weight_ptr + channels[:, None].to(tl.int64) * stride_w + taps[None, :],
                     mask=channel_mask[:, None] & (taps[None, :] < KERNEL), other=0.0)  # [BLOCK_D, BLOCK_K]
    acc = tl.sum(window.to(tl.float32) * weight.to(tl.float32), axis=1)  # [BLOCK_D]
    activated = acc * tl.sigmoid(acc)
    tl.store(out_ptr + req.to(tl.int64) * stride_out + channels, activated.to(out_ptr.dtype.element_ty),
             mask=channel_mask)


@triton.jit
def gdn_decode_kernel(
    qkv_ptr, stride_qkv,  # [B, conv_dim]: conv output, q | k | v channels
    g_ptr, stride_g,  # [B, HV] fp32 log-decay
    beta_ptr, stride_beta,  # [B, HV]
    state_ptr, stride_s_slot, stride_s_head, stride_s_k,  # [S, HV, Dk, Dv] fp32, Dv contiguous
    state_indices_ptr,  # [B] int32: each request's slot
    out_ptr, stride_o_req, stride_o_head,  # [B, HV, Dv], Dv contiguous
    scale, eps,
    KEY_DIM: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, V_HEADS_PER_K_HEAD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, STREAM_STATE: tl.constexpr,
):
    """One gated delta-rule step for one (request, value head, Dv tile), state updated in place."""
    req = tl.program_id(0)
    v_head = tl.program_id(1)
    k_head = v_head // V_HEADS_PER_K_HEAD  # GVA: consecutive value heads share a q/k head
    rows_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    cols_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    mask_k = rows_k < HEAD_K
    mask_v = cols_v < HEAD_V

    qkv_row = qkv_ptr + req.to(tl.int64) * stride_qkv
    q = tl.load(qkv_row + k_head * HEAD_K + rows_k, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
    k = tl.load(qkv_row + KEY_DIM + k_head * HEAD_K + rows_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(qkv_row + 2 * KEY_DIM + v_head * HEAD_V + cols_v, mask=mask_v, other=0.0).to(tl.float32)
    # Every Dv tile needs the whole q and k norms, so each program recomputes them (Dk values).
    q = q * (tl.math.rsqrt(tl.sum(q * q, axis=0) + eps) * scale)
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + eps)
    decay = tl.exp(tl.load(g_ptr + req.to(tl.int64) * stride_g + v_head).to(tl.float32))
    beta = tl.load(beta_ptr + req.to(tl.int64) * stride_beta + v_head).to(tl.float32)

    slot = tl.load(state_indices_ptr + req).to(tl.int64)
    state_tile = (state_ptr + slot * stride_s_slot + v_head * stride_s_head
                  + rows_k[:, None] * stride_s_k + cols_v[None, :])  # [BLOCK_K, BLOCK_V]
    tile_mask = mask_k[:, None] & mask_v[None, :]
    if STREAM_STATE:  # each state byte is read and written once per step: keep it out of L2
        state = tl.load(state_tile, mask=tile_mask, other=0.0, eviction_policy="evict_first")
    else:
        state = tl.load(state_tile, mask=tile_mask, other=0.0)
    state = state.to(tl.float32) * decay  # [BLOCK_K, BLOCK_V]
    predicted_v = tl.sum(state * k[:, None], axis=0)  # [BLOCK_V]: S^T k, what the state recalls for k
    correction = beta * (v - predicted_v)  # [BLOCK_V]
    state = state + k[:, None] * correction[None, :]
    out = tl.sum(state * q[:, None], axis=0)  # [BLOCK_V]: S^T q
    if STREAM_STATE:  # fp32 math, one rounding
        tl.store(state_tile, state.to(state_ptr.dtype.element_ty), mask=tile_mask, cache_modifier=".cs")
    else:
        tl.store(state_tile, state.to(state_ptr.dtype.element_ty), mask=tile_mask)
    tl.store(out_ptr + req.to(tl.int64) * stride_o_req + v_head * stride_o_head + cols_v,
             out.to(out_ptr.dtype.element_ty), mask=mask_v)


def conv_decode_step(x, conv_state, weight, state_indices, out, block_d: int = 256, num_warps: int = 4):
    """Causal depthwise conv + SiLU for one token per request, updating ``conv_state`` in place.

    ``x [B, D]`` (this step's inputs), ``conv_state [S, D, K]`` (slot-indexed, oldest tap first),
    ``weight [D, K]``, ``state_indices [B]`` int32, ``out [B, D]`` (written and returned). The
    request's state becomes its last K inputs and ``out = SiLU(sum_j state[:, j] * weight[:, j])``.
    """
    num_reqs, dim = x.shape
    kernel_width = conv_state.shape[2]
    if conv_state.shape[1] != dim or tuple(weight.shape) != (dim, kernel_width):
        raise ValueError(f"conv_decode_step: x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)} and "
                         f"weight {tuple(weight.shape)} disagree on [D, K]")
    _check_decode_common("conv_decode_step", num_reqs, state_indices, out, (num_reqs, dim))
    if x.stride(1) != 1 or conv_state.stride(2) != 1 or weight.stride(1) != 1:
        raise ValueError("conv_decode_step needs x rows, conv_state taps and weight taps contiguous")
    if num_reqs == 0:
        return out
    block_d = min(block_d, triton.next_power_of_2(dim))
    conv_decode_kernel[(num_reqs, triton.cdiv(dim, block_d))](
        x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), weight, weight.stride(0),
        state_indices, out, out.stride(0), dim,
        KERNEL=kernel_width, BLOCK_K=triton.next_power_of_2(kernel_width), BLOCK_D=block_d, num_warps=num_warps,
    )
    return out


def gdn_decode_step(mixed_qkv, g, beta, recurrent_state, state_indices, out, *, num_k_heads: int,
                    head_k_dim: int, block_v: int = 64, num_warps: int | None = None,
                    stream_state: bool | None = None, eps: float = 1e-6):
    """One gated delta-rule step per request, on the request's slot of ``recurrent_state``.

    ``mixed_qkv [B, conv_dim]`` is the conv output (q | k | v channels), ``g [B, HV]`` fp32
    log-decay, ``beta [B, HV]``, ``recurrent_state [S, HV, Dk, Dv]`` (fp32, or a 16-bit float: the
    update runs in fp32 and is rounded once when stored; updated in place),
    ``state_indices [B]`` int32, ``out [B, HV, Dv]`` (written and returned). q and k are
    L2-normalised in fp32 and q is scaled by ``Dk ** -0.5``; value head h uses q/k head
    ``h // (HV // H)``.
    """
    num_reqs = mixed_qkv.shape[0]
    num_v_heads, head_v_dim = recurrent_state.shape[1], recurrent_state.shape[3]
    key_dim = num_k_heads * head_k_dim
    if num_v_heads % num_k_heads:
        raise ValueError(f"gdn_decode_step: num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}")
    if recurrent_state.shape[2] != head_k_dim or mixed_qkv.shape[1] != 2 * key_dim + num_v_heads * head_v_dim:
        raise ValueError(f"gdn_decode_step: mixed_qkv {tuple(mixed_qkv.shape)} and recurrent_state "
                         f"{tuple(recurrent_state.shape)} do not match {num_k_heads} k heads of {head_k_dim}")
    if not recurrent_state.is_floating_point() or recurrent_state.element_size() not in (2, 4):
        raise ValueError(f"gdn_decode_step needs a float32, bfloat16 or float16 recurrent_state, "
                         f"got {recurrent_state.dtype}")
    for name, gate in (("g", g), ("beta", beta)):
        if tuple(gate.shape) != (num_reqs, num_v_heads) or gate.stride(1) != 1:
            raise ValueError(f"gdn_decode_step: {name} must be [{num_reqs}, {num_v_heads}] with contiguous heads, "
                             f"got {tuple(gate.shape)}")
    _check_decode_common("gdn_decode_step", num_reqs, state_indices, out, (num_reqs, num_v_heads, head_v_dim))
    if mixed_qkv.stride(1) != 1 or recurrent_state.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("gdn_decode_step needs mixed_qkv rows, recurrent_state rows and out rows contiguous")
    if num_reqs == 0:
        return out
    # H200 sweep at Qwen3-Next shapes (benchmarks/kernel_bench/bench_gdn.py): fp32 states are fastest with 4 warps
    # and default caching (3.74 TB/s at batch 256); 16-bit ones with 2 warps and streaming hints
    # (181 vs 197 us at batch 256, the fp32 choices).
    sixteen_bit = recurrent_state.element_size() == 2
    num_warps = num_warps or (2 if sixteen_bit else 4)
    stream_state = sixteen_bit if stream_state is None else stream_state
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    gdn_decode_kernel[(num_reqs, num_v_heads, triton.cdiv(head_v_dim, block_v))](
        mixed_qkv, mixed_qkv.stride(0), g, g.stride(0), beta, beta.stride(0),
        recurrent_state, recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        state_indices, out, out.stride(0), out.stride(1),
        head_k_dim ** -0.5, eps,
        KEY_DIM=key_dim, HEAD_K=head_k_dim, HEAD_V=head_v_dim, V_HEADS_PER_K_HEAD=num_v_heads // num_k_heads,
        BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, STREAM_STATE=stream_state,
        num_warps=num_warps,
    )
    return out


def _check_decode_common(kernel: str, num_reqs: int, state_indices, out, out_shape: tuple[int, ...]) -> None:
    """Shape and dtype checks shared by both launchers (host metadata only, no device reads)."""
    if tuple(state_indices.shape) != (num_reqs,) or state_indices.is_floating_point() \
            or state_indices.element_size() != 4:
        raise ValueError(f"{kernel}: state_indices must be int32 [{num_reqs}], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if tuple(out.shape) != out_shape:
        raise ValueError(f"{kernel}: out must be {list(out_shape)}, got {list(out.shape)}")
