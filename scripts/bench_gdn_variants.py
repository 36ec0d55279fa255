"""Experimental Gated DeltaNet decode-kernel variants against Weir's kernel, at Qwen3-Next shapes
(H=16, HV=32, Dk=Dv=128), timed in CUDA graphs; each variant's output and state checked against
the kept kernel first.

    python3 scripts/bench_gdn_variants.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from bench_gdn import graph_us  # scripts/ is on the path when this runs as a script
from weir.plugins.attention.gdn_triton_kernels import gdn_decode_step

H, HV, DK, DV = 16, 32, 128, 128
KEY_DIM = H * DK
CONV_DIM = 2 * KEY_DIM + HV * DV


@triton.jit
def _update_tile(state_tile, q, k, v, decay, beta, out_ptrs, STREAM: tl.constexpr):
    """Decay, delta-rule update and readout of one [Dk, BLOCK_V] state tile, stored back in place."""
    if STREAM:
        state = tl.load(state_tile, eviction_policy="evict_first")
    else:
        state = tl.load(state_tile)
    state = state.to(tl.float32) * decay
    correction = beta * (v - tl.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * correction[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    if STREAM:
        tl.store(state_tile, state.to(state_tile.dtype.element_ty), cache_modifier=".cs")
    else:
        tl.store(state_tile, state.to(state_tile.dtype.element_ty))
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty))


@triton.jit
def _state_first_kernel(qkv_ptr, stride_qkv, g_ptr, stride_g, beta_ptr, stride_beta, state_ptr, stride_s_slot,
                        stride_s_head, stride_s_k, state_indices_ptr, out_ptr, stride_o_req, stride_o_head,
                        scale, eps, KEY_DIM: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr,
                        V_HEADS_PER_K_HEAD: tl.constexpr, BLOCK_V: tl.constexpr, STREAM: tl.constexpr):
    """The kept kernel with the state load issued before the q/k loads and norms."""
    req = tl.program_id(0)
    v_head = tl.program_id(1)
    k_head = v_head // V_HEADS_PER_K_HEAD
    rows_k = tl.arange(0, HEAD_K)
    cols_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    slot = tl.load(state_indices_ptr + req).to(tl.int64)
    state_tile = (state_ptr + slot * stride_s_slot + v_head * stride_s_head
                  + rows_k[:, None] * stride_s_k + cols_v[None, :])
    if STREAM:  # issued first: in flight while q and k load and normalise
        first = tl.load(state_tile, eviction_policy="evict_first")
    else:
        first = tl.load(state_tile)
    qkv_row = qkv_ptr + req.to(tl.int64) * stride_qkv
    q = tl.load(qkv_row + k_head * HEAD_K + rows_k).to(tl.float32)
    k = tl.load(qkv_row + KEY_DIM + k_head * HEAD_K + rows_k).to(tl.float32)
    v = tl.load(qkv_row + 2 * KEY_DIM + v_head * HEAD_V + cols_v).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + req.to(tl.int64) * stride_g + v_head).to(tl.float32))
    beta = tl.load(beta_ptr + req.to(tl.int64) * stride_beta + v_head).to(tl.float32)
    q = q * (tl.math.rsqrt(tl.sum(q * q, axis=0) + eps) * scale)
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + eps)
    state = first.to(tl.float32) * decay
    correction = beta * (v - tl.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * correction[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    if STREAM:
        tl.store(state_tile, state.to(state_ptr.dtype.element_ty), cache_modifier=".cs")
    else:
        tl.store(state_tile, state.to(state_ptr.dtype.element_ty))
    tl.store(out_ptr + req.to(tl.int64) * stride_o_req + v_head * stride_o_head + cols_v,
             out.to(out_ptr.dtype.element_ty))


@triton.jit
def _looped_kernel(qkv_ptr, stride_qkv, g_ptr, stride_g, beta_ptr, stride_beta, state_ptr, stride_s_slot,
                   stride_s_head, stride_s_k, state_indices_ptr, out_ptr, stride_o_req, stride_o_head,
                   scale, eps, KEY_DIM: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr,
                   V_HEADS_PER_K_HEAD: tl.constexpr, BLOCK_V: tl.constexpr, STREAM: tl.constexpr,
                   NUM_STAGES: tl.constexpr):
    """One program per (request, value head): q/k normalised once, a pipelined loop over Dv tiles."""
    req = tl.program_id(0)
    v_head = tl.program_id(1)
    k_head = v_head // V_HEADS_PER_K_HEAD
    rows_k = tl.arange(0, HEAD_K)
    slot = tl.load(state_indices_ptr + req).to(tl.int64)
    head_state = state_ptr + slot * stride_s_slot + v_head * stride_s_head + rows_k[:, None] * stride_s_k
    qkv_row = qkv_ptr + req.to(tl.int64) * stride_qkv
    q = tl.load(qkv_row + k_head * HEAD_K + rows_k).to(tl.float32)
    k = tl.load(qkv_row + KEY_DIM + k_head * HEAD_K + rows_k).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + req.to(tl.int64) * stride_g + v_head).to(tl.float32))
    beta = tl.load(beta_ptr + req.to(tl.int64) * stride_beta + v_head).to(tl.float32)
    q = q * (tl.math.rsqrt(tl.sum(q * q, axis=0) + eps) * scale)
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + eps)
    for v_start in tl.range(0, HEAD_V, BLOCK_V, num_stages=NUM_STAGES):
        cols_v = v_start + tl.arange(0, BLOCK_V)
        v = tl.load(qkv_row + 2 * KEY_DIM + v_head * HEAD_V + cols_v).to(tl.float32)
        _update_tile(head_state + cols_v[None, :], q, k, v, decay, beta,
                     out_ptr + req.to(tl.int64) * stride_o_req + v_head * stride_o_head + cols_v, STREAM)


def launch(variant, mixed, g, beta, state, slots, out, block_v, num_warps, stream, num_stages=1):
    batch = mixed.shape[0]
    args = (mixed, mixed.stride(0), g, g.stride(0), beta, beta.stride(0), state, state.stride(0), state.stride(1),
            state.stride(2), slots, out, out.stride(0), out.stride(1), DK ** -0.5, 1e-6)
    meta = dict(KEY_DIM=KEY_DIM, HEAD_K=DK, HEAD_V=DV, V_HEADS_PER_K_HEAD=HV // H, BLOCK_V=block_v, STREAM=stream,
                num_warps=num_warps)
    if variant == "state_first":
        _state_first_kernel[(batch, HV, DV // block_v)](*args, **meta)
    elif variant == "looped":
        _looped_kernel[(batch, HV)](*args, NUM_STAGES=num_stages, **meta)
    else:
        gdn_decode_step(mixed, g, beta, state, slots, out, num_k_heads=H, head_k_dim=DK, block_v=block_v,
                        num_warps=num_warps, stream_state=stream)


def main() -> None:
    torch.manual_seed(0)
    for state_dtype, batch in itertools.product((torch.bfloat16, torch.float32), (8, 64, 256)):
        num_slots = 512
        mixed = torch.randn(batch, CONV_DIM, dtype=torch.bfloat16, device="cuda")
        g = -torch.rand(batch, HV, device="cuda")
        beta = torch.rand(batch, HV, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(num_slots, device="cuda")[:batch].to(torch.int32)
        initial = (torch.randn(num_slots + 1, HV, DK, DV, device="cuda") * 0.1).to(state_dtype)
        reference_state, reference_out = initial.clone(), torch.empty(batch, HV, DV, dtype=torch.bfloat16,
                                                                      device="cuda")
        launch("kept", mixed, g, beta, reference_state, slots, reference_out, 64, 4, False)
        configs = [("kept", bv, w, s, 1) for bv in (8, 16, 32, 64) for w in (1, 2, 4) for s in (False, True)]
        stream = state_dtype != torch.float32  # the kept kernel's best hint per dtype
        configs += [("state_first", bv, w, stream, 1) for bv in (16, 32, 64) for w in (1, 2, 4)]
        configs += [("looped", bv, w, stream, st) for bv in (16, 32, 64) for w in (2, 4) for st in (1, 2, 3)]
        results = []
        for variant, block_v, num_warps, stream, num_stages in configs:
            state, out = initial.clone(), torch.empty_like(reference_out)
            try:
                launch(variant, mixed, g, beta, state, slots, out, block_v, num_warps, stream, num_stages)
            except Exception as error:  # a config Triton cannot compile
                print(f"  {variant} {block_v} {num_warps} {stream} {num_stages}: {type(error).__name__}")
                continue
            torch.cuda.synchronize()
            state_error = (state.float() - reference_state.float()).abs().max().item()
            out_error = (out.float() - reference_out.float()).abs().max().item()
            if state_error > 1e-2 or out_error > 5e-2:
                print(f"  WRONG {variant} {block_v} {num_warps} {stream} {num_stages}: state {state_error} "
                      f"out {out_error}")
                continue
            micros = graph_us(lambda: launch(variant, mixed, g, beta, state, slots, out, block_v, num_warps, stream,
                                             num_stages))
            results.append((micros, variant, block_v, num_warps, stream, num_stages))
        state_bytes = 2 * batch * HV * DK * DV * initial.element_size()
        name = str(state_dtype).removeprefix("torch.")
        default = graph_us(lambda: gdn_decode_step(mixed, g, beta, initial, slots, reference_out, num_k_heads=H,
                                                   head_k_dim=DK))
        print(f"B={batch} {name}: current default {default:.1f} us ({state_bytes / default / 1e3:.0f} GB/s)")
        for micros, variant, block_v, num_warps, stream, num_stages in sorted(results)[:8]:
            print(f"    {micros:7.1f} us ({state_bytes / micros / 1e3:5.0f} GB/s) {variant:11s} block_v {block_v:3d} "
                  f"warps {num_warps} stream {stream} stages {num_stages}")
        for variant in ("kept", "state_first", "looped"):
            best = min((r for r in results if r[1] == variant), default=None)
            if best:
                print(f"    best {variant}: {best[0]:.1f} us {best[2:]}")
        print(flush=True)


if __name__ == "__main__":
    main()
