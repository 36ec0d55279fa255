"""Kernel benchmarks on a CUDA device: ``python3 -m benchmarks.kernel_bench.bench_<name>`` from the repo root."""
