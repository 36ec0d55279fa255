"""Microseconds per call of the sampler and the small layer ops: torch vs Triton, on CUDA.

    python3 -m benchmarks.kernel_bench.bench_small_ops [--iters 50]

The torch column runs with WEIR_DISABLE_TRITON=1 (the reference ops), the Triton column
without it; both go through the same public entry points (Sampler, RMSNorm, GatedMLP's
activation, RotaryEmbedding). Times are CUDA-event medians after a warm-up that compiles.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from benchmarks.kernel_bench.timing import median_us
from weir.kernels.dispatch import forced_torch_ops, use_triton
from weir.layers import RMSNorm, RotaryEmbedding
from weir.sample import Sampler
from weir.sampling_params import SamplingParams


def sampling_metadata(params: list[SamplingParams], seeds: list[int], positions: list[int], vocab: int):
    """A CUDA sampler holding ``params`` in rows 0.. and the metadata of the batch of all its rows."""
    sampler = Sampler.for_params(params, seeds, vocab, device="cuda")
    rows = torch.arange(len(params), device="cuda")
    metadata = sampler.batch_metadata(rows, rows.cpu().numpy(), torch.tensor(positions, device="cuda"))
    return sampler, metadata


def compare(name: str, fn: Callable[[], object], iters: int) -> None:
    with forced_torch_ops(True):
        torch_us = median_us(fn, iters)
    with forced_torch_ops(False):
        triton_us = median_us(fn, iters)
    print(f"{name:<56} {torch_us:>11.1f} {triton_us:>11.1f} {torch_us / triton_us:>8.1f}x", flush=True)


def sampler_cases(iters: int) -> None:
    num_rows, vocab = 256, 151936
    logits = torch.randn(num_rows, vocab, device="cuda") * 4
    seeds, positions = list(range(num_rows)), [1000 + row for row in range(num_rows)]
    for label, params in [
        ("temperature 0.6", SamplingParams(temperature=0.6)),
        ("greedy (torch argmax on both paths)", SamplingParams(temperature=0)),
        ("top-p 0.9", SamplingParams(temperature=0.6, top_p=0.9)),
        ("top-k 50", SamplingParams(temperature=0.6, top_k=50)),
        ("repetition 1.1 + top-p 0.9", SamplingParams(temperature=0.6, top_p=0.9, repetition_penalty=1.1)),
    ]:
        sampler, metadata = sampling_metadata([params] * num_rows, seeds, positions, vocab)
        compare(f"sampler B={num_rows} V={vocab} {label}", lambda: sampler.sample_batch(logits, metadata), iters)
    # Language-model-like rows: a few likely tokens over a long tail (most noise is skipped).
    peaked = logits.clone()
    peaked[:, :8] += 30.0
    sampler, metadata = sampling_metadata([SamplingParams(temperature=0.6, top_p=0.9)] * num_rows, seeds, positions,
                                          vocab)
    compare(f"sampler B={num_rows} V={vocab} top-p 0.9, peaked rows", lambda: sampler.sample_batch(peaked, metadata),
            iters)
    search_sweep(logits, seeds, positions, iters)
    gumbel_sweep(seeds, positions, iters)


def gumbel_sweep(seeds: list[int], positions: list[int], iters: int) -> None:
    """The Gumbel-max kernel alone under other launch shapes, on near-flat rows (a random-weight
    model's logits: every block draws noise) at decode batch sizes: picks the defaults."""
    from weir.sample import triton_sampler

    vocab = 151936
    print(f"Gumbel-max choice alone, near-flat rows, V={vocab} (defaults: {triton_sampler.GUMBEL_PROGRAMS_PER_SM} "
          f"programs per SM, block {triton_sampler.GUMBEL_BLOCK}, {triton_sampler.GUMBEL_WARPS} warps)")
    for num_rows in (256, 64, 8):
        logits = torch.randn(num_rows, vocab, device="cuda") * 0.1
        _, metadata = sampling_metadata([SamplingParams(temperature=0.6)] * num_rows, seeds[:num_rows],
                                        positions[:num_rows], vocab)
        for per_sm, block, warps in [(2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (16, 1024, 4), (8, 2048, 8),
                                     (16, 512, 4), (32, 512, 4), (8, 4096, 8)]:
            micros = median_us(lambda: triton_sampler.choose_tokens_triton(logits, metadata, per_sm, block, warps),
                               iters)
            print(f"  B={num_rows:<4} {per_sm:>2} programs/SM block {block:>4} warps {warps}: {micros:>8.1f} us",
                  flush=True)


def search_sweep(logits: torch.Tensor, seeds: list[int], positions: list[int], iters: int) -> None:
    """The filter-threshold kernel alone under other (block, slots, warps): picks the defaults."""
    from weir.sample import triton_sample_filters as filters

    num_rows, vocab = logits.shape
    print(f"filter thresholds alone, B={num_rows} V={vocab} (defaults: block {filters.SEARCH_BLOCK}, "
          f"slots {filters.SEARCH_SLOTS}, warps {filters.SEARCH_WARPS})")
    for label, params in [("top-p 0.9", SamplingParams(temperature=0.6, top_p=0.9)),
                          ("top-k 50", SamplingParams(temperature=0.6, top_k=50))]:
        _, metadata = sampling_metadata([params] * num_rows, seeds, positions, vocab)
        for block, slots, warps in [(512, 8, 8), (256, 8, 4), (1024, 8, 8), (512, 16, 8), (256, 16, 4), (512, 4, 8)]:
            micros = median_us(lambda: filters.filter_thresholds_triton(logits, metadata, block, slots, warps), iters)
            print(f"  {label:<10} block {block:>4} slots {slots:>2} warps {warps:>2}: {micros:>9.1f} us", flush=True)


def layer_cases(iters: int) -> None:
    dtype = torch.bfloat16
    for num_tokens, hidden in ((8192, 1024), (256, 4096)):
        norm = RMSNorm(hidden).to(device="cuda", dtype=dtype)
        torch.nn.init.ones_(norm.weight)
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
        residual = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype) * 0.01
        compare(f"RMSNorm+residual [{num_tokens}, {hidden}] bf16", lambda: norm(x, residual), iters)

    intermediate = 3072
    gate_up = torch.randn(8192, 2 * intermediate, device="cuda", dtype=dtype)

    def silu_and_mul():
        if not use_triton(gate_up):
            return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        from weir.kernels.triton_layers import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)

    compare(f"SiLU-and-mul [8192, 2*{intermediate}] bf16", silu_and_mul, iters)

    num_tokens, num_heads, num_kv_heads, head_dim = 8192, 16, 8, 128
    config = LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=32768)
    rope = RotaryEmbedding(config, head_dim, 32768)
    rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
    rope.materialize_buffers(torch.device("cuda"))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", dtype=dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 32768, (num_tokens,), device="cuda")
    compare(f"RoPE [{num_tokens}, {num_heads}+{num_kv_heads} heads, {head_dim}] bf16",
            lambda: rope(positions, q, k), iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_small_ops needs a CUDA device")
    print(f"{'op':<56} {'torch us':>11} {'triton us':>11} {'speedup':>9}")
    with torch.no_grad():
        sampler_cases(args.iters)
        layer_cases(args.iters)


if __name__ == "__main__":
    main()
