"""Milliseconds per MoE expert call at Qwen3-Next-80B shapes: torch vs Triton backends, on CUDA.

    python3 -m benchmarks.kernels.bench_moe [--iters 30] [--tokens 1,16,64] [--sweep] [--sweep-parts] [--shared]

E=512 experts, top_k=10, H=2048, I=512, bf16, random weights and softmax routing. "GB/s" is the
bytes of the experts a batch touches (distinct ids x 3*H*I*2) over the time: decode is weight
streaming, so it should approach the HBM peak. "triton graph" replays the call from a CUDA
graph, as decode runs it; the eager columns include Python launch overhead (the torch backend
syncs, so it has no graph column). --sweep times other tile sets per batch, to tune
BF16_TILE_TABLE in weir.plugins.moe_backends.triton_fused_kernels. --shared times Qwen3-Next's
shared expert both ways (a separate gated MLP after the routed experts, or a 513th expert in the
fused kernels), routing included. Times are CUDA-event medians.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.kernels.timing import graph_replay, median_ms
from weir.moe import Routing, softmax_top_k
from weir.plugins.moe_backends.torch_ref import TorchMoEBackend
from weir.plugins.moe_backends.triton_fused import TritonMoEBackend
from weir.plugins.moe_backends.triton_fused_kernels import GemmTiles, MoETiles, default_moe_tiles

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 512, 10, 2048, 512
ROUTING = Routing.softmax_top_k(NUM_EXPERTS, TOP_K, renormalize=True)
EXPERT_BYTES = 3 * HIDDEN * INTERMEDIATE * 2  # gate, up and down rows of one bf16 expert
SWEEP_GEMMS = [  # (gate_up, down) pairs; each is tried with every block_m the batch can fill
    (GemmTiles(32, 128, 4, 4), GemmTiles(64, 128, 4, 4)),
    (GemmTiles(16, 128, 4, 4), GemmTiles(32, 128, 4, 4)),
    (GemmTiles(64, 128, 4, 3), GemmTiles(128, 128, 8, 3)),
    (GemmTiles(64, 64, 4, 3), GemmTiles(128, 64, 4, 3)),
    (GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 3)),
    (GemmTiles(64, 64, 4, 4), GemmTiles(64, 64, 4, 4)),
    # Prefill (hundreds of rows per expert): wider tiles, more warps, to raise reuse per byte.
    (GemmTiles(64, 64, 8, 4), GemmTiles(128, 64, 8, 4)),
    (GemmTiles(128, 64, 8, 4), GemmTiles(128, 128, 8, 3)),
    (GemmTiles(64, 128, 8, 3), GemmTiles(256, 64, 8, 4)),
]


def time_ms(fn: Callable[[], object], iters: int, graph: bool) -> float:
    """Median ms of ``fn``, or of replaying a CUDA graph of it (as decode runs it)."""
    return median_ms(graph_replay(fn) if graph else fn, iters)


def make_batch(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
    router_logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", dtype=torch.bfloat16, generator=generator)
    topk_weights, topk_ids = softmax_top_k(router_logits, TOP_K, renormalize=True)
    return hidden, topk_weights, topk_ids


def sweep(num_tokens: int, batch, weights, iters: int) -> None:
    default = default_moe_tiles(num_tokens, TOP_K, NUM_EXPERTS, torch.bfloat16)
    mean_rows = num_tokens * TOP_K / NUM_EXPERTS
    backend = TritonMoEBackend()
    results = []
    for block_m in (16, 32, 64, 128):
        if block_m > 16 and block_m > 4 * mean_rows:  # blocks mostly padding: not worth compiling
            continue
        for gate_up, down in SWEEP_GEMMS:
            backend.tiles = MoETiles(block_m, gate_up, down)
            results.append((time_ms(lambda: backend.experts(*batch, *weights), iters, graph=True), backend.tiles))
    flops = num_tokens * TOP_K * 3 * HIDDEN * INTERMEDIATE * 2  # gate, up and down GEMMs
    ranked = sorted(results, key=lambda result: result[0])
    for milliseconds, tiles in ranked[:5] + [result for result in ranked[5:] if result[1] == default]:
        marker = "  (default)" if tiles == default else ""
        print(f"    {milliseconds:8.3f} ms {flops / milliseconds / 1e9:6.0f} TFLOP/s  {tiles}{marker}", flush=True)


PART_GEMMS = [GemmTiles(block_n, block_k, warps, stages) for block_n, block_k, warps, stages in (
    (32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 4, 4),
    (32, 256, 4, 2), (64, 256, 4, 2), (128, 256, 8, 2), (16, 256, 4, 2), (256, 64, 8, 3), (64, 512, 4, 1))]


def sweep_parts(num_tokens: int, batch, weights, iters: int) -> None:
    """One GEMM's tiles at a time, the other kept at the default: --sweep tries the two only in
    fixed pairs, so a better tile for one of them alone would go unseen."""
    default = default_moe_tiles(num_tokens, TOP_K, NUM_EXPERTS, torch.bfloat16)
    backend = TritonMoEBackend()
    for part in ("gate_up", "down"):
        results = []
        for gemm in PART_GEMMS:
            backend.tiles = MoETiles(default.block_m, gemm if part == "gate_up" else default.gate_up,
                                     gemm if part == "down" else default.down)
            results.append((time_ms(lambda: backend.experts(*batch, *weights), iters, graph=True), gemm))
        ranked = sorted(results, key=lambda result: result[0])
        default_gemm = getattr(default, part)
        default_ms = next(ms for ms, gemm in results if gemm == default_gemm) if default_gemm in PART_GEMMS else None
        print(f"    {part}: default {default_gemm} {default_ms or float('nan'):.3f} ms; best "
              + "; ".join(f"{ms:.3f} ms {gemm}" for ms, gemm in ranked[:3]), flush=True)


def shared_expert_ways(num_tokens: int, weights, iters: int) -> None:
    """Routed experts plus a sigmoid-gated shared expert of the same width: as a separate MLP
    (router GEMM, fused routing, experts, shared gate/up GEMM, SiLU-and-mul, down GEMM, sigmoid,
    product, sum) or as expert 512 of the fused kernels (router GEMM with the gate row, one routing
    kernel, experts)."""
    import torch.nn.functional as F

    generator = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
    router = torch.randn(NUM_EXPERTS + 1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    shared_gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16,
                                 generator=generator) * 0.02
    shared_down = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    with_shared = (torch.cat([weights[0], shared_gate_up[None]]), torch.cat([weights[1], shared_down[None]]))
    backend = TritonMoEBackend()

    def separate():
        logits = hidden @ router.T  # [T, E + 1]
        routed = backend.forward(hidden, logits[:, :NUM_EXPERTS], *weights, ROUTING)
        gate, up = (hidden @ shared_gate_up.T).chunk(2, dim=-1)
        shared = (F.silu(gate) * up) @ shared_down.T
        return routed + torch.sigmoid(logits[:, NUM_EXPERTS:]) * shared

    def fused():
        logits = hidden @ router.T
        return backend.forward(hidden, logits[:, :NUM_EXPERTS], *with_shared, ROUTING, num_shared_experts=1,
                               shared_gate_logits=logits[:, NUM_EXPERTS:])

    separate_ms, fused_ms = (time_ms(fn, iters, graph=True) for fn in (separate, fused))
    error = (fused().float() - separate().float()).abs().max().item() / separate().float().abs().max().item()
    print(f"{num_tokens:>6} tokens: shared expert separate {separate_ms:8.3f} ms, fused {fused_ms:8.3f} ms "
          f"({separate_ms / fused_ms:.2f}x); max relative difference {error:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tokens", default="1,16,64,256,512,2048,8192")
    parser.add_argument("--sweep", action="store_true", help="also time other tile sets (slow: compiles)")
    parser.add_argument("--shared", action="store_true", help="only time the two ways to run a shared expert")
    parser.add_argument("--sweep-parts", action="store_true", help="only sweep each GEMM's tiles alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA device")
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = (
        torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16,
                    generator=generator) * 0.02,  # w_gate_up [E, 2I, H]
        torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16,
                    generator=generator) * 0.02,  # w_down [E, H, I]
    )
    if args.shared:
        with torch.no_grad():
            for num_tokens in (int(value) for value in args.tokens.split(",")):
                shared_expert_ways(num_tokens, weights, args.iters)
        return
    if args.sweep_parts:
        with torch.no_grad():
            for num_tokens in (int(value) for value in args.tokens.split(",")):
                print(f"{num_tokens} tokens", flush=True)
                sweep_parts(num_tokens, make_batch(num_tokens, seed=num_tokens), weights, args.iters)
        return
    torch_backend, triton_backend = TorchMoEBackend(), TritonMoEBackend()
    print(f"{'tokens':>6} {'experts':>7} {'torch ms':>9} {'triton ms':>10} {'graph ms':>9} {'speedup':>8} "
          f"{'torch GB/s':>11} {'graph GB/s':>11}  tiles")
    with torch.no_grad():
        for num_tokens in (int(value) for value in args.tokens.split(",")):
            batch = make_batch(num_tokens, seed=num_tokens)
            touched_bytes = batch[2].unique().numel() * EXPERT_BYTES
            torch_ms = time_ms(lambda: torch_backend.experts(*batch, *weights), args.iters, graph=False)
            triton_ms = time_ms(lambda: triton_backend.experts(*batch, *weights), args.iters, graph=False)
            graph_ms = time_ms(lambda: triton_backend.experts(*batch, *weights), args.iters, graph=True)
            tiles = default_moe_tiles(num_tokens, TOP_K, NUM_EXPERTS, torch.bfloat16)
            print(f"{num_tokens:>6} {touched_bytes // EXPERT_BYTES:>7} {torch_ms:>9.3f} {triton_ms:>10.3f} "
                  f"{graph_ms:>9.3f} {torch_ms / graph_ms:>7.1f}x {touched_bytes / torch_ms / 1e6:>11.0f} "
                  f"{touched_bytes / graph_ms / 1e6:>11.0f}  block_m {tiles.block_m}", flush=True)
            if args.sweep:
                sweep(num_tokens, batch, weights, args.iters)


if __name__ == "__main__":
    main()
