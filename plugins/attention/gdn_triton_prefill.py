"""Weir's Triton conv for Gated DeltaNet prefill: varlen causal conv + SiLU over slot-indexed states,
writing q and k L2-normalised and q, k and v each in its own contiguous buffer.

fla's ``causal_conv1d`` wants a contiguous input and gathered states and returns one ``[T,
conv_dim]`` buffer; its chunk kernel then copies the q, k and v column slices of that buffer to
contiguous tensors and L2-normalises q and k in two more kernels. At a 16k-token Qwen3-Next
prefill step those copies, the gather and the scatter took about as long as the conv itself.
Here the conv reads the strided input rows and the request's conv state in place, and its
output is what ``chunk_gated_delta_rule`` reads as is (with ``use_qk_l2norm_in_kernel=False``).

Numerics follow ``gdn_torch_ops``: the window is in the input dtype (state values converted to
it), taps are summed in fp32, the SiLU output is rounded to the input dtype, and q and k are then
normalised in fp32 from those rounded values (``x * rsqrt(sum(x^2) + eps)``, fla's l2norm) and
rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_taps(x_rows, stride_x, seq_start, state_taps, weights, positions, tile_mask,
               KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, WITH_STATE: tl.constexpr):
    """fp32 ``sum_tap weight[tap] * input[position - (KERNEL - 1) + tap]`` for a [BLOCK_T, BLOCK_C]
    tile: inputs from rows of x or, before the request's first row (WITH_STATE only), from its
    conv state's last KERNEL - 1 taps, in x's dtype."""
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for tap in tl.static_range(KERNEL):
        source = positions - (KERNEL - 1) + tap  # [BLOCK_T] position of the input this tap reads
        if WITH_STATE:
            from_x = (source >= 0)[:, None]
            value = tl.load(x_rows + (seq_start + source)[:, None] * stride_x, mask=tile_mask & from_x, other=0.0)
            kept = tl.load(state_taps + (KERNEL + source)[:, None], mask=tile_mask & (source < 0)[:, None],
                           other=0.0)
            value = tl.where(from_x, value, kept.to(value.dtype))
        else:
            value = tl.load(x_rows + (seq_start + source)[:, None] * stride_x, mask=tile_mask, other=0.0)
        tap_weight = tl.load(weights + tap).to(tl.float32)  # [BLOCK_C]
        acc += value.to(tl.float32) * tap_weight[None, :]
    return acc


@triton.jit
def _conv_prefill_kernel(
    x_ptr, stride_x,  # [T, D] pre-conv q|k|v channels, channels contiguous
    conv_state_ptr, stride_cs_slot, stride_cs_chan,  # [S, D, K], oldest tap first, taps contiguous
    weight_ptr, stride_w,  # [D, K], taps contiguous
    slots_ptr,  # [N] each request's state slot
    cu_seqlens_ptr,  # [N + 1] first row of each request in x
    chunk_indices_ptr,  # [num_chunks, 2] (request, chunk of it)
    q_ptr, k_ptr, v_ptr,  # [T, H, Dk], [T, H, Dk], [T, HV, Dv], contiguous
    eps,
    NUM_K_HEADS: tl.constexpr, NUM_V_HEADS: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, EVEN_HEADS: tl.constexpr,
):
    """One program per (head, chunk of BLOCK_T tokens of one request); heads are q heads, k heads,
    then v heads. Heads vary fastest, so programs running together read whole rows of x."""
    head = tl.program_id(0)
    chunk = tl.program_id(1)
    req = tl.load(chunk_indices_ptr + chunk * 2)
    chunk_in_req = tl.load(chunk_indices_ptr + chunk * 2 + 1)
    seq_start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + req + 1).to(tl.int64) - seq_start
    slot = tl.load(slots_ptr + req).to(tl.int64)
    positions = chunk_in_req * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] within the request
    token_valid = positions < seq_len
    is_key_head = head < 2 * NUM_K_HEADS  # q or k: normalised
    cols = tl.arange(0, BLOCK_C)  # [BLOCK_C]
    if EVEN_HEADS:  # every head is BLOCK_C wide: no column masks, so loads and stores vectorise
        channels = head * BLOCK_C + cols
        tile_mask = token_valid[:, None]  # [BLOCK_T, 1]
    else:
        first_channel = tl.where(is_key_head, head * HEAD_K,
                                 2 * NUM_K_HEADS * HEAD_K + (head - 2 * NUM_K_HEADS) * HEAD_V)
        col_valid = cols < tl.where(is_key_head, HEAD_K, HEAD_V)
        channels = first_channel + cols
        tile_mask = token_valid[:, None] & col_valid[None, :]  # [BLOCK_T, BLOCK_C]
    x_rows = x_ptr + channels[None, :]
    state_taps = conv_state_ptr + slot * stride_cs_slot + channels[None, :].to(tl.int64) * stride_cs_chan
    if EVEN_HEADS:
        weights = weight_ptr + channels.to(tl.int64) * stride_w  # [BLOCK_C]
    else:
        weights = weight_ptr + tl.where(col_valid, channels, 0).to(tl.int64) * stride_w
    # Two straight-line copies of the tap loop, so the compiler can issue all the taps' loads at
    # once; only a request's first chunk reaches back into its state.
    if chunk_in_req == 0:
        acc = _conv_taps(x_rows, stride_x, seq_start, state_taps, weights, positions, tile_mask,
                         KERNEL=KERNEL, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, WITH_STATE=True)
    else:
        acc = _conv_taps(x_rows, stride_x, seq_start, state_taps, weights, positions, tile_mask,
                         KERNEL=KERNEL, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, WITH_STATE=False)
    activated = (acc * tl.sigmoid(acc)).to(x_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_T, BLOCK_C]
    normalised = activated * tl.math.rsqrt(tl.sum(activated * activated, axis=1) + eps)[:, None]
    out = tl.where(is_key_head, normalised, activated).to(q_ptr.dtype.element_ty)

    rows = (seq_start + positions)[:, None]  # [BLOCK_T, 1] output rows
    key_width = NUM_K_HEADS * HEAD_K
    if head < NUM_K_HEADS:
        tl.store(q_ptr + rows * key_width + head * HEAD_K + cols[None, :], out, mask=tile_mask)
    elif is_key_head:
        tl.store(k_ptr + rows * key_width + (head - NUM_K_HEADS) * HEAD_K + cols[None, :], out, mask=tile_mask)
    else:
        tl.store(v_ptr + rows * (NUM_V_HEADS * HEAD_V) + (head - 2 * NUM_K_HEADS) * HEAD_V + cols[None, :], out,
                 mask=tile_mask)


@triton.jit
def _conv_state_final_kernel(
    x_ptr, stride_x,  # [T, D]
    conv_state_ptr, stride_cs_slot, stride_cs_chan,  # [S, D, K]
    slots_ptr, cu_seqlens_ptr,  # [N], [N + 1]
    dim,
    KERNEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The request's conv state becomes its last KERNEL inputs (reaching into the old state when
    the request has fewer tokens). Runs after the conv kernel, which reads the old state."""
    req = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    channel_mask = channels < dim
    taps = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    seq_start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + req + 1).to(tl.int64) - seq_start
    slot = tl.load(slots_ptr + req).to(tl.int64)
    state_rows = conv_state_ptr + slot * stride_cs_slot + channels[:, None].to(tl.int64) * stride_cs_chan
    source = seq_len - KERNEL + taps  # [BLOCK_K] position of the input that becomes each tap
    from_x = source >= 0
    tap_valid = taps < KERNEL
    x_value = tl.load(x_ptr + (seq_start + source)[None, :] * stride_x + channels[:, None],
                      mask=channel_mask[:, None] & (from_x & tap_valid)[None, :], other=0.0)  # [BLOCK_D, BLOCK_K]
    kept = tl.load(state_rows + (KERNEL + source)[None, :],
                   mask=channel_mask[:, None] & ((source < 0) & tap_valid)[None, :], other=0.0)
    # As the reference: old state values pass through the input dtype.
    kept = kept.to(x_ptr.dtype.element_ty).to(conv_state_ptr.dtype.element_ty)
    window = tl.where(from_x[None, :], x_value.to(conv_state_ptr.dtype.element_ty), kept)
    # A tap kept from the old state is read by one thread and rewritten by another: every read of
    # this program lands before any write.
    tl.debug_barrier()
    tl.store(state_rows + taps[None, :], window, mask=channel_mask[:, None] & tap_valid[None, :])


def conv_prefill(
    x: torch.Tensor,  # [T, D] pre-conv q|k|v channels; rows may be strided
    conv_state: torch.Tensor,  # [S, D, K] slot-indexed, updated in place
    weight: torch.Tensor,  # [D, K]
    state_slots: torch.Tensor,  # [N] integer slots of the requests
    cu_seqlens: torch.Tensor,  # [N + 1] integer rows of x where each request starts, from 0
    chunk_indices: torch.Tensor,  # [num_chunks, 2] integer (request, chunk of chunk_size tokens)
    *, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, chunk_size: int = 64,
    eps: float = 1e-6, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k [T, H, Dk] normalised; v [T, HV, Dv]
    """Causal depthwise conv + SiLU of several requests' tokens, continuing from their conv states.

    Each request's tokens are the rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of ``x``; its slot's
    state (its last K inputs before these) is read, and after the conv replaced by the last K
    inputs. q and k come back L2-normalised (not scaled). ``chunk_indices`` is fla's varlen chunk
    table for ``chunk_size``-token chunks (``gdn_fla.chunk_indices_from_query_start_loc``).
    """
    num_tokens, dim = x.shape
    kernel_width = conv_state.shape[2]
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    if dim != 2 * key_dim + value_dim or conv_state.shape[1] != dim or tuple(weight.shape) != (dim, kernel_width):
        raise ValueError(f"conv_prefill: x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)} and weight "
                         f"{tuple(weight.shape)} do not match {num_k_heads}x{head_k_dim} q/k heads and "
                         f"{num_v_heads}x{head_v_dim} v heads")
    if x.stride(1) != 1 or conv_state.stride(2) != 1 or weight.stride(1) != 1:
        raise ValueError("conv_prefill needs x channels, conv_state taps and weight taps contiguous")
    if chunk_size < kernel_width - 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"conv_prefill: chunk_size {chunk_size} must be a power of two of at least the conv's "
                         f"reach ({kernel_width - 1})")
    num_reqs = state_slots.shape[0]
    if tuple(cu_seqlens.shape) != (num_reqs + 1,) or chunk_indices.ndim != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(f"conv_prefill: {num_reqs} slots need cu_seqlens [{num_reqs + 1}] and chunk_indices "
                         f"[num_chunks, 2], got {tuple(cu_seqlens.shape)} and {tuple(chunk_indices.shape)}")
    q = torch.empty(num_tokens, num_k_heads, head_k_dim, dtype=x.dtype, device=x.device)
    k = torch.empty_like(q)
    v = torch.empty(num_tokens, num_v_heads, head_v_dim, dtype=x.dtype, device=x.device)
    num_chunks = chunk_indices.shape[0]
    if num_tokens == 0 or num_chunks == 0:
        return q, k, v
    # The kernels index these flat: a strided view would send a request to another's slot.
    state_slots, cu_seqlens = state_slots.contiguous(), cu_seqlens.contiguous()
    chunk_indices = chunk_indices.contiguous()
    block_c = triton.next_power_of_2(max(head_k_dim, head_v_dim))
    _conv_prefill_kernel[(2 * num_k_heads + num_v_heads, num_chunks)](
        x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), weight, weight.stride(0),
        state_slots, cu_seqlens, chunk_indices, q, k, v, eps,
        NUM_K_HEADS=num_k_heads, NUM_V_HEADS=num_v_heads, HEAD_K=head_k_dim, HEAD_V=head_v_dim,
        KERNEL=kernel_width, BLOCK_T=chunk_size, BLOCK_C=block_c,
        EVEN_HEADS=head_k_dim == head_v_dim == block_c, num_warps=num_warps,
    )
    block_d = min(256, triton.next_power_of_2(dim))
    _conv_state_final_kernel[(num_reqs, triton.cdiv(dim, block_d))](
        x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), state_slots, cu_seqlens, dim,
        KERNEL=kernel_width, BLOCK_K=triton.next_power_of_2(kernel_width), BLOCK_D=block_d, num_warps=4,
    )
    return q, k, v
