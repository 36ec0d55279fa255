"""Dummy weights and ``weir bench`` on a CUDA device (marked gpu; run on the device machine)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

QWEN3_8B = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "qwen3-8b"


def test_dummy_qwen3_8b_is_made_on_the_device_quickly():
    from weir.config import EngineArgs
    from weir.plugin_manager import load_plugins
    from weir.weights.dummy import DUMMY_HIGH
    from weir.weights.loader import load_model

    config = EngineArgs(model=str(QWEN3_8B), load_format="dummy", dtype="bfloat16").create_config("cuda")
    model_cls = load_plugins().resolve_model(config.model.architecture)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated_before = torch.cuda.memory_allocated()  # other tests' engines may still hold memory
    start = time.perf_counter()
    model = load_model(model_cls, config.model, torch.device("cuda"), iter(()))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 16.0e9 < weight_bytes < 16.7e9  # Qwen3-8B: 8.19 B parameters in bf16, untied
    assert seconds < 15, f"dummy load took {seconds:.1f} s"
    # No staging copy: the peak is the weights plus small buffers (rotary tables).
    assert torch.cuda.max_memory_allocated() - allocated_before < weight_bytes * 1.05
    for name, param in model.named_parameters():
        assert param.is_cuda and param.dtype == torch.bfloat16, name
        if "norm" not in name:
            assert param.abs().max() <= DUMMY_HIGH, name


GPU_ENGINE = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "256",
              "--gpu-memory-utilization", "0.3"]


def test_bench_latency_on_cuda_measures_copy_bandwidth(config_only_qwen3, tmp_path):
    from weir.cli.bench import bench_app

    result_file = tmp_path / "latency.json"
    result = CliRunner().invoke(bench_app, ["latency", str(config_only_qwen3), *GPU_ENGINE, "--batch-size", "1",
                                            "--input-len", "16", "--output-len", "32", "--num-iters", "3",
                                            "--num-iters-warmup", "1", "--output-json", str(result_file)])
    assert result.exit_code == 0, result.output
    record = json.loads(result_file.read_text())
    assert record["device"].startswith("cuda")
    # an H200 copies at a few TB/s; anything under 500 GB/s means the timing is broken
    assert record["copy_bandwidth_bytes_per_second"] > 5e11
    assert 0 < record["fraction_of_copy_bandwidth"] < 1.5


def test_bench_throughput_on_cuda(config_only_qwen3, tmp_path):
    from weir.cli.bench import bench_app

    result_file = tmp_path / "throughput.json"
    result = CliRunner().invoke(bench_app, ["throughput", str(config_only_qwen3), *GPU_ENGINE, "--num-prompts", "32",
                                            "--random-range", "8:64,4:32", "--output-json", str(result_file)])
    assert result.exit_code == 0, result.output
    record = json.loads(result_file.read_text())
    assert record["output_tokens"] > 0 and record["output_tokens_per_second"] > 0
