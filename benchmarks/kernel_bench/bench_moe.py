"""Milliseconds per MoE expert call at a real model's shapes: torch vs Triton backends, on CUDA.

    python3 -m benchmarks.kernel_bench.bench_moe [--shape qwen3-next|deepseek-v3|kimi-linear] [--iters 30]
                                                 [--tokens 1,16,64] [--sweep] [--sweep-parts] [--shared]

Shapes (bf16, random weights, random routing that spreads tokens over the experts about
evenly): ``qwen3-next`` is Qwen3-Next-80B's E=512, top_k=10, H=2048, I=512; ``deepseek-v3`` is
DeepSeek-V3/V3.2's E=256, top_k=8, H=7168, I=2048 plus its shared expert as a 257th expert
every token takes (as the DeepSeek model runs it); ``kimi-linear`` is Kimi-Linear-48B's E=256,
top_k=8, H=2304, I=1024 with its shared expert the same way. "GB/s" is the bytes of the experts a batch
touches (distinct ids x 3*H*I*2) over the time: decode is weight streaming, so it should
approach the HBM peak. "triton graph" replays the call from a CUDA graph, as decode runs it;
the eager columns include Python launch overhead (the torch backend syncs, so it has no graph
column). --sweep times other tile sets per batch, to tune BF16_TILE_TABLE in
weir.plugins.moe_backends.triton_fused_kernels. --shared times Qwen3-Next's shared expert both
ways (a separate gated MLP after the routed experts, or a 513th expert in the fused kernels),
routing included. Times are CUDA-event medians.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.kernel_bench.timing import graph_replay, median_ms
from weir.moe import Routing, append_shared_experts, softmax_top_k
from weir.plugins.moe_backends.torch_ref import TorchMoEBackend
from weir.plugins.moe_backends.triton_fused import TritonMoEBackend
from weir.plugins.moe_backends.triton_fused_kernels import GemmTiles, MoETiles, default_moe_tiles


@dataclass(frozen=True)
class MoEShape:
    """One model's expert layer: routed experts, slots per token, sizes, shared experts."""

    num_experts: int  # routed
    top_k: int
    hidden: int
    intermediate: int
    num_shared: int = 0  # extra experts every token takes at weight 1, after the routed ones

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * 2  # gate, up and down rows of one bf16 expert

    @property
    def slots(self) -> int:
        return self.top_k + self.num_shared

    @property
    def routing(self) -> Routing:
        return Routing.softmax_top_k(self.num_experts, self.top_k, renormalize=True)


SHAPES = {"qwen3-next": MoEShape(512, 10, 2048, 512),
          "deepseek-v3": MoEShape(256, 8, 7168, 2048, num_shared=1),
          "kimi-linear": MoEShape(256, 8, 2304, 1024, num_shared=1)}
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


def make_batch(shape: MoEShape, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    router_logits = torch.randn(num_tokens, shape.num_experts, device="cuda", dtype=torch.bfloat16,
                                generator=generator)
    topk_weights, topk_ids = softmax_top_k(router_logits, shape.top_k, renormalize=True)
    if shape.num_shared:
        topk_weights, topk_ids = append_shared_experts(topk_weights, topk_ids, shape.num_experts, shape.num_shared,
                                                         None)
    return hidden, topk_weights, topk_ids


def default_tiles(shape: MoEShape, num_tokens: int) -> MoETiles:
    """The tiles the backend picks for this call (the experts with the shared ones, as the model calls it)."""
    return default_moe_tiles(num_tokens, shape.slots, shape.num_experts + shape.num_shared, torch.bfloat16)


def sweep(shape: MoEShape, num_tokens: int, batch, weights, iters: int) -> None:
    default = default_tiles(shape, num_tokens)
    mean_rows = num_tokens * shape.slots / (shape.num_experts + shape.num_shared)
    backend = TritonMoEBackend()
    results = []
    for block_m in (16, 32, 64, 128):
        if block_m > 16 and block_m > 4 * mean_rows:  # blocks mostly padding: not worth compiling
            continue
        for gate_up, down in SWEEP_GEMMS:
            backend.tiles = MoETiles(block_m, gate_up, down)
            results.append((time_ms(lambda: backend.experts(*batch, *weights), iters, graph=True), backend.tiles))
    flops = num_tokens * shape.slots * 3 * shape.hidden * shape.intermediate * 2  # gate, up and down GEMMs
    ranked = sorted(results, key=lambda result: result[0])
    for milliseconds, tiles in ranked[:5] + [result for result in ranked[5:] if result[1] == default]:
        marker = "  (default)" if tiles == default else ""
        print(f"    {milliseconds:8.3f} ms {flops / milliseconds / 1e9:6.0f} TFLOP/s  {tiles}{marker}", flush=True)


PART_GEMMS = [GemmTiles(block_n, block_k, warps, stages) for block_n, block_k, warps, stages in (
    (32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 4, 4),
    (32, 256, 4, 2), (64, 256, 4, 2), (128, 256, 8, 2), (16, 256, 4, 2), (256, 64, 8, 3), (64, 512, 4, 1))]


def sweep_parts(shape: MoEShape, num_tokens: int, batch, weights, iters: int) -> None:
    """One GEMM's tiles at a time, the other kept at the default: --sweep tries the two only in
    fixed pairs, so a better tile for one of them alone would go unseen."""
    default = default_tiles(shape, num_tokens)
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


def shared_expert_ways(shape: MoEShape, num_tokens: int, weights, iters: int) -> None:
    """Routed experts plus a sigmoid-gated shared expert of the same width: as a separate MLP
    (router GEMM, fused routing, experts, shared gate/up GEMM, SiLU-and-mul, down GEMM, sigmoid,
    product, sum) or as one more expert of the fused kernels (router GEMM with the gate row, one
    routing kernel, experts)."""
    import torch.nn.functional as F

    hidden_size, intermediate, num_routed, routing = shape.hidden, shape.intermediate, shape.num_experts, shape.routing
    generator = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    router = torch.randn(num_routed + 1, hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    shared_gate_up = torch.randn(2 * intermediate, hidden_size, device="cuda", dtype=torch.bfloat16,
                                 generator=generator) * 0.02
    shared_down = torch.randn(hidden_size, intermediate, device="cuda", dtype=torch.bfloat16,
                              generator=generator) * 0.02
    with_shared = (torch.cat([weights[0], shared_gate_up[None]]), torch.cat([weights[1], shared_down[None]]))
    backend = TritonMoEBackend()

    def separate():
        logits = hidden @ router.T  # [T, E + 1]
        routed = backend.forward(hidden, logits[:, :num_routed], *weights, routing)
        gate, up = (hidden @ shared_gate_up.T).chunk(2, dim=-1)
        shared = (F.silu(gate) * up) @ shared_down.T
        return routed + torch.sigmoid(logits[:, num_routed:]) * shared

    def fused():
        logits = hidden @ router.T
        return backend.forward(hidden, logits[:, :num_routed], *with_shared, routing, num_shared_experts=1,
                               shared_gate_logits=logits[:, num_routed:])

    separate_ms, fused_ms = (time_ms(fn, iters, graph=True) for fn in (separate, fused))
    error = (fused().float() - separate().float()).abs().max().item() / separate().float().abs().max().item()
    print(f"{num_tokens:>6} tokens: shared expert separate {separate_ms:8.3f} ms, fused {fused_ms:8.3f} ms "
          f"({separate_ms / fused_ms:.2f}x); max relative difference {error:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-next")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tokens", default="1,16,64,256,512,2048,8192")
    parser.add_argument("--sweep", action="store_true", help="also time other tile sets (slow: compiles)")
    parser.add_argument("--shared", action="store_true", help="only time the two ways to run a shared expert")
    parser.add_argument("--sweep-parts", action="store_true", help="only sweep each GEMM's tiles alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA device")
    shape = SHAPES[args.shape]
    if args.shared and shape.num_shared:
        raise SystemExit(f"--shared adds a shared expert to a shape without one; {args.shape} has its own")
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_experts = shape.num_experts + shape.num_shared
    weights = (
        torch.randn(num_experts, 2 * shape.intermediate, shape.hidden, device="cuda", dtype=torch.bfloat16,
                    generator=generator) * 0.02,  # w_gate_up [E, 2I, H]
        torch.randn(num_experts, shape.hidden, shape.intermediate, device="cuda", dtype=torch.bfloat16,
                    generator=generator) * 0.02,  # w_down [E, H, I]
    )
    print(f"{args.shape}: {shape}", flush=True)
    if args.shared:
        with torch.no_grad():
            for num_tokens in (int(value) for value in args.tokens.split(",")):
                shared_expert_ways(shape, num_tokens, weights, args.iters)
        return
    if args.sweep_parts:
        with torch.no_grad():
            for num_tokens in (int(value) for value in args.tokens.split(",")):
                print(f"{num_tokens} tokens", flush=True)
                sweep_parts(shape, num_tokens, make_batch(shape, num_tokens, seed=num_tokens), weights, args.iters)
        return
    torch_backend, triton_backend = TorchMoEBackend(), TritonMoEBackend()
    print(f"{'tokens':>6} {'experts':>7} {'torch ms':>9} {'triton ms':>10} {'graph ms':>9} {'speedup':>8} "
          f"{'torch GB/s':>11} {'graph GB/s':>11}  tiles")
    with torch.no_grad():
        for num_tokens in (int(value) for value in args.tokens.split(",")):
            batch = make_batch(shape, num_tokens, seed=num_tokens)
            touched_bytes = batch[2].unique().numel() * shape.expert_bytes
            torch_ms = time_ms(lambda: torch_backend.experts(*batch, *weights), args.iters, graph=False)
            triton_ms = time_ms(lambda: triton_backend.experts(*batch, *weights), args.iters, graph=False)
            graph_ms = time_ms(lambda: triton_backend.experts(*batch, *weights), args.iters, graph=True)
            tiles = default_tiles(shape, num_tokens)
            print(f"{num_tokens:>6} {touched_bytes // shape.expert_bytes:>7} {torch_ms:>9.3f} {triton_ms:>10.3f} "
                  f"{graph_ms:>9.3f} {torch_ms / graph_ms:>7.1f}x {touched_bytes / torch_ms / 1e6:>11.0f} "
                  f"{touched_bytes / graph_ms / 1e6:>11.0f}  block_m {tiles.block_m}", flush=True)
            if args.sweep:
                sweep(shape, num_tokens, batch, weights, args.iters)


if __name__ == "__main__":
    main()
