"""Gated DeltaNet kernel timings on CUDA at Qwen3-Next shapes (H=16, HV=32, Dk=Dv=128, conv 8192x4):
Weir's varlen prefill conv against fla's conv and the copies it replaced (eager), Weir's
slot-indexed decode kernels (conv, and the recurrent step with a sweep of its tiles and cache
hints; bandwidth counts the recurrent state read and written) timed in CUDA graphs, and fla's
chunk prefill (eager).

    python3 -m benchmarks.kernel_bench.bench_gdn [--only prefill-conv|decode|chunk]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_bench.timing import graph_us, median_ms
from weir.plugins.attention.gdn_triton_kernels import conv_decode_step, gdn_decode_step

H, HV, DK, DV, CONV_KERNEL = 16, 32, 128, 128, 4
CONV_DIM = 2 * H * DK + HV * DV


def decode_us(fn) -> float:
    """Microseconds per call of ``fn`` replayed 20 times in one CUDA graph: kernel time without
    Python's launch cost (eager timings at small batches measure ~35 us of that)."""
    return graph_us(fn, repeats=20)


def decode(batch: int, state_dtype: torch.dtype) -> None:
    num_slots = 512
    state = torch.zeros(num_slots + 1, HV, DK, DV, dtype=state_dtype, device="cuda")
    conv_state = torch.zeros(num_slots + 1, CONV_DIM, CONV_KERNEL, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(num_slots, device="cuda")[:batch].to(torch.int32)
    mixed = torch.randn(batch, CONV_DIM, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(CONV_DIM, CONV_KERNEL, dtype=torch.bfloat16, device="cuda")
    g = -torch.rand(batch, HV, device="cuda")
    beta = torch.rand(batch, HV, dtype=torch.bfloat16, device="cuda")
    conv_out = torch.empty_like(mixed)
    out = torch.empty(batch, HV, DV, dtype=torch.bfloat16, device="cuda")
    conv_us = decode_us(lambda: conv_decode_step(mixed, conv_state, weight, slots, conv_out))
    recurrent_us = decode_us(lambda: gdn_decode_step(conv_out, g, beta, state, slots, out, num_k_heads=H,
                                                     head_k_dim=DK))
    state_bytes = 2 * batch * HV * DK * DV * state.element_size()
    results = []
    for block_v in (32, 64, 128):
        for num_warps in (2, 4, 8):
            for stream in (False, True):
                micros = decode_us(lambda: gdn_decode_step(
                    conv_out, g, beta, state, slots, out, num_k_heads=H, head_k_dim=DK, block_v=block_v,
                    num_warps=num_warps, stream_state=stream))
                results.append((micros, block_v, num_warps, stream))
    best = min(results)
    name = str(state_dtype).removeprefix("torch.")
    print(f"decode B={batch:4d} {name} state: conv {conv_us:6.1f} us; recurrent (defaults) {recurrent_us:6.1f} us "
          f"({state_bytes / recurrent_us / 1e3:5.0f} GB/s), best {best[0]:6.1f} us "
          f"({state_bytes / best[0] / 1e3:5.0f} GB/s) block_v {best[1]} warps {best[2]} streaming {best[3]}",
          flush=True)
    for micros, block_v, num_warps, stream in sorted(results)[:4]:
        print(f"    {micros:7.1f} us  block_v {block_v:3d} warps {num_warps} streaming {stream}")
    if state_dtype == torch.float32:  # the conv does not depend on it
        conv = sorted((decode_us(lambda: conv_decode_step(mixed, conv_state, weight, slots, conv_out,
                                                          block_d=block_d, num_warps=num_warps)), block_d, num_warps)
                      for block_d in (128, 256, 512, 1024, 2048) for num_warps in (2, 4, 8))
        print("    conv (block_d, warps): " + ", ".join(f"{us:.1f} us ({bd}, {nw})" for us, bd, nw in conv[:4]))


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
    ms = median_ms(lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                  cu_seqlens=cu, cu_seqlens_cpu=bounds),
                 iters=10)
    print(f"fla chunk T={num_tokens} seqs={num_seqs}: {ms:.2f} ms")


def prefill_conv(num_tokens: int, num_seqs: int) -> None:
    """Weir's varlen prefill conv (strided input, q/k/v out in separate buffers, states in place)
    against what it replaced: fla's conv on a contiguous copy with gathered and scattered states,
    and the q/k/v copies and q/k L2 norms of fla's chunk entry."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.l2norm import l2norm_fwd

    from weir.plugins.attention.gdn_fla import chunk_indices_from_query_start_loc
    from weir.plugins.attention.gdn_triton_prefill import conv_prefill

    in_proj = torch.randn(num_tokens, CONV_DIM + 2 * HV * DV // 2, dtype=torch.bfloat16, device="cuda")
    mixed = in_proj[:, :CONV_DIM]  # a column slice, as the model's in_proj output gives it
    weight = torch.randn(CONV_DIM, CONV_KERNEL, dtype=torch.bfloat16, device="cuda")
    conv_state = torch.zeros(513, CONV_DIM, CONV_KERNEL, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(512, device="cuda")[:num_seqs]
    bounds = torch.linspace(0, num_tokens, num_seqs + 1).long()
    cu, chunks = bounds.cuda(), torch.tensor(chunk_indices_from_query_start_loc(bounds.numpy(), 64), device="cuda")

    def weir(num_warps=4):
        return conv_prefill(mixed, conv_state, weight, slots, cu, chunks, num_k_heads=H, head_k_dim=DK,
                            num_v_heads=HV, head_v_dim=DV, num_warps=num_warps)

    def fla():
        out, final = causal_conv1d(x=mixed.contiguous().unsqueeze(0), weight=weight,
                                   initial_state=conv_state.index_select(0, slots), output_final_state=True,
                                   activation="silu", cu_seqlens=cu, cu_seqlens_cpu=bounds, chunk_indices=chunks)
        conv_state.index_copy_(0, slots, final)
        q, k, v = out[0].split([H * DK, H * DK, HV * DV], dim=-1)
        l2norm_fwd(q.contiguous().view(-1, DK)), l2norm_fwd(k.contiguous().view(-1, DK)), v.contiguous()

    moved = 2 * mixed.numel() * mixed.element_size()  # x read once, q|k|v written once
    start_state = conv_state.clone()
    expected = weir()
    timings = []
    for num_warps in (4, 8, 16):
        conv_state.copy_(start_state)
        outputs = weir(num_warps)
        same = all(torch.equal(a, b) for a, b in zip(outputs, expected))
        timings.append(f"{num_warps} warps {median_ms(lambda: weir(num_warps), iters=20) * 1e3:.0f} us"
                       f"{'' if same else ' (OUTPUT DIFFERS)'}")
    fla_ms = median_ms(fla, iters=20)
    weir_ms = median_ms(weir, iters=20)
    print(f"prefill conv T={num_tokens} seqs={num_seqs}: Weir {weir_ms * 1e3:.0f} us ({moved / weir_ms / 1e9:.2f} "
          f"TB/s; {', '.join(timings)}), fla conv + copies + norms {fla_ms * 1e3:.0f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("prefill-conv", "decode", "chunk"), help="run one of the three parts")
    args = parser.parse_args()
    if args.only in (None, "prefill-conv"):
        for num_tokens, num_seqs in ((16384, 16), (8192, 256)):
            prefill_conv(num_tokens, num_seqs)
    if args.only in (None, "decode"):
        for state_dtype in (torch.float32, torch.bfloat16):
            for batch in (8, 64, 256):
                decode(batch, state_dtype)
    if args.only in (None, "chunk"):
        for num_tokens, num_seqs in ((8192, 16), (8192, 256)):
            chunk(num_tokens, num_seqs)


if __name__ == "__main__":
    main()
