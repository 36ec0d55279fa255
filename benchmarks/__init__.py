"""Weir's benchmarks, profilers and the race against vLLM (run from the repo root, see README.md)."""
