"""Gated DeltaNet kernel timings on CUDA at Qwen3-Next shapes (H=16, HV=32, Dk=Dv=128, conv 8192x4):
Weir's slot-indexed decode kernels (recurrent step: achieved bandwidth on the fp32 state it
reads and writes, with a tile sweep) and fla's chunk prefill. Timings are of eager launches: at
small batches they measure Python's launch cost (~35 us), not the kernel (profile_steps.py does).

    python3 scripts/bench_gdn.py
"""

from __future__ import annotations

import torch

from weir.plugins.attention.gdn_triton_kernels import conv_decode_step, gdn_decode_step

H, HV, DK, DV, CONV_KERNEL = 16, 32, 128, 128, 4
CONV_DIM = 2 * H * DK + HV * DV


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def decode(batch: int) -> None:
    num_slots = 512
    state = torch.zeros(num_slots + 1, HV, DK, DV, dtype=torch.float32, device="cuda")
    conv_state = torch.zeros(num_slots + 1, CONV_DIM, CONV_KERNEL, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(num_slots, device="cuda")[:batch].to(torch.int32)
    mixed = torch.randn(batch, CONV_DIM, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(CONV_DIM, CONV_KERNEL, dtype=torch.bfloat16, device="cuda")
    g = -torch.rand(batch, HV, device="cuda")
    beta = torch.rand(batch, HV, dtype=torch.bfloat16, device="cuda")
    conv_out = torch.empty_like(mixed)
    out = torch.empty(batch, HV, DV, dtype=torch.bfloat16, device="cuda")
    conv_ms = time_ms(lambda: conv_decode_step(mixed, conv_state, weight, slots, conv_out))
    state_bytes = 2 * batch * HV * DK * DV * 4
    results = []
    for block_v in (16, 32, 64, 128):
        for num_warps in (2, 4, 8):
            ms = time_ms(lambda: gdn_decode_step(conv_out, g, beta, state, slots, out, num_k_heads=H, head_k_dim=DK,
                                                 block_v=block_v, num_warps=num_warps))
            results.append((ms, block_v, num_warps))
    results.sort()
    default = next(ms for ms, bv, nw in results if bv == 64 and nw == 4)  # gdn_decode_step's defaults
    best = results[0]
    print(f"decode B={batch:4d}: conv {conv_ms * 1e3:6.1f} us; recurrent default {default * 1e3:7.1f} us "
          f"({state_bytes / default / 1e6:6.0f} GB/s), best {best[0] * 1e3:7.1f} us "
          f"({state_bytes / best[0] / 1e6:6.0f} GB/s) block_v {best[1]} warps {best[2]}")


def chunk(num_tokens: int, num_seqs: int) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q = torch.randn(1, num_tokens, H, DK, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, num_tokens, H, DK, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, num_tokens, HV, DV, dtype=torch.bfloat16, device="cuda")
    g = -torch.rand(1, num_tokens, HV, device="cuda")
    beta = torch.rand(1, num_tokens, HV, dtype=torch.bfloat16, device="cuda")
    bounds = torch.linspace(0, num_tokens, num_seqs + 1).long()
    cu = bounds.cuda()
    h0 = torch.zeros(num_seqs, HV, DK, DV, dtype=torch.float32, device="cuda")
    ms = time_ms(lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=bounds),
                 iters=10)
    print(f"fla chunk T={num_tokens} seqs={num_seqs}: {ms:.2f} ms")


def main() -> None:
    for batch in (1, 16, 64, 256):
        decode(batch)
    for num_tokens, num_seqs in ((8192, 16), (8192, 256)):
        chunk(num_tokens, num_seqs)


if __name__ == "__main__":
    main()
