"""Kernel benchmarks on a CUDA device: ``python3 -m benchmarks.kernels.bench_<name>`` from the repo root."""
