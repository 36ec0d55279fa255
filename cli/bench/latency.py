"""``weir bench latency``: time one fixed batch end to end, and the memory bandwidth a decode step
achieves against what the device can copy.

Definitions (printed with the numbers):
- decode step time = (median full latency - median prefill-only latency) / (output_len - 1): a
  prefill-only run (max_tokens=1) has the same prefill and fixed costs, so the difference is the
  decode steps alone;
- weight bytes per decode step = every parameter byte, except an input embedding table not tied to
  the LM head (a decode step reads only its batch's rows of it), and of a MoE layer's routed experts
  only those the batch's tokens reach: exactly top_k at batch 1, and for larger batches the expected
  number under uniform routing, E * (1 - (1 - top_k / E) ** batch) (an estimate; the printout says
  so); KV-cache reads are left out;
- device copy bandwidth = 2 * bytes / time of a large device-to-device copy (bytes read + written
  per second), the practical ceiling for streaming weights.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import typer

from weir.cli.bench.common import (ENGINE_ERRORS, check_fits, check_writable, fail, human_bytes, percentiles,
                                   sized_for_workload, start_engine, token_id_bound, write_json)
from weir.cli.engine_options import with_engine_options

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def decode_weight_bytes(model: Any, batch_size: int = 1) -> int:
    """Parameter bytes a decode step of ``batch_size`` requests reads (see the module docstring)."""
    read_fraction = {id(param): fraction for param, fraction in _routed_expert_fractions(model, batch_size)}
    shared_ids = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared_ids.setdefault(id(param), []).append(name)
    total = 0.0
    for names in shared_ids.values():
        param = model.get_parameter(names[0])
        untied_input_embedding = len(names) == 1 and names[0].endswith("embed_tokens.weight")
        if not untied_input_embedding:
            total += param.numel() * param.element_size() * read_fraction.get(id(param), 1.0)
    return round(total)


def _routed_expert_fractions(model: Any, batch_size: int) -> list[tuple[Any, float]]:
    """(expert parameter, fraction of its experts a decode step reads) for every MoE layer: a
    FusedExperts module, whose routing sends each token to ``top_k`` of them."""
    from weir.layers.moe import FusedExperts

    fractions = []
    for experts in model.modules():
        if isinstance(experts, FusedExperts):
            top_k = experts.routing.top_k
            num_experts, num_shared = experts.num_experts, experts.num_shared_experts
            expected = num_experts * (1 - (1 - min(top_k, num_experts) / num_experts) ** batch_size)
            # Shared experts, stored after the routed ones, are read by every step.
            read = (expected + num_shared) / (num_experts + num_shared)
            fractions += [(param, read) for param in experts.parameters()]
    return fractions


def measure_copy_bandwidth(platform: Any, device: Any, num_bytes: int) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``num_bytes`` on ``device``."""
    import torch

    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    destination.copy_(source)  # first touch: page faults and allocator growth are not bandwidth
    platform.synchronize()
    start = time.perf_counter()
    destination.copy_(source)
    platform.synchronize()
    # Enough repeats for ~0.2 s of copying, so the host's timing overhead is negligible.
    repeats = max(3, min(200, int(0.2 / max(time.perf_counter() - start, 1e-6))))
    start = time.perf_counter()
    for _ in range(repeats):
        destination.copy_(source)
    platform.synchronize()
    elapsed = time.perf_counter() - start
    del source, destination
    return 2 * num_bytes * repeats / elapsed


def _copy_size(platform: Any, device: Any) -> int:
    if device.type == "cpu":
        return 256 << 20
    free, _ = platform.memory_info()
    return max(64 << 20, min(2 << 30, free // 4))  # two buffers, leave the rest to the engine


def _timed_runs(llm: Any, prompts: list[dict], params: Any, count: int, label: str) -> list[float]:
    from tqdm.auto import tqdm

    seconds = []
    for _ in tqdm(range(count), desc=label, unit="run", disable=count == 0):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    return seconds


def _bandwidth_report(llm: Any, full: list[float], prefill: list[float], output_len: int, batch_size: int,
                      measure_copy: bool) -> dict[str, Any]:
    runner = llm.engine.runner
    weight_bytes = decode_weight_bytes(runner.model, batch_size)
    report: dict[str, Any] = {"weight_bytes_per_decode_step": weight_bytes, "device": str(runner.device)}
    routed = _routed_expert_fractions(runner.model, batch_size)
    note = ""
    if routed and batch_size > 1:
        note = " (routed experts: the expected number a batch reaches under uniform routing, an estimate)"
        report["weight_bytes_estimated"] = True
    elif routed:
        note = " (routed experts: the top_k each layer reads for one token)"
    typer.echo(f"Weights: {human_bytes(runner.weight_bytes)}; read per decode step: {human_bytes(weight_bytes)}"
               f"{note}")
    if output_len < 2:
        typer.echo("Decode steps: none (output_len 1); no bandwidth figure")
        return report
    step_seconds = (statistics.median(full) - statistics.median(prefill)) / (output_len - 1)
    if step_seconds <= 0:
        typer.echo("Decode step time: not measurable (runs too short or too noisy); raise --output-len")
        return report
    achieved = weight_bytes / step_seconds
    report.update(decode_step_seconds=step_seconds, achieved_bytes_per_second=achieved)
    typer.echo(f"Decode step: {step_seconds * 1e3:.3f} ms; weight bytes / step time: {human_bytes(achieved)}/s")
    if measure_copy:
        num_bytes = _copy_size(runner.platform, runner.device)
        copy = measure_copy_bandwidth(runner.platform, runner.device, num_bytes)
        report.update(copy_bytes=num_bytes, copy_bandwidth_bytes_per_second=copy,
                      fraction_of_copy_bandwidth=achieved / copy)
        typer.echo(f"Device copy bandwidth: {human_bytes(copy)}/s (2 x {human_bytes(num_bytes)} / copy time: "
                   f"bytes read + written per second)")
        typer.echo(f"Achieved fraction of copy bandwidth: {achieved / copy:.3f}")
    return report


@with_engine_options
def latency(
    model: str = typer.Argument(..., help="checkpoint folder or .gguf file; with --load-format dummy, "
                                          "a folder holding config.json suffices"),
    batch_size: int = typer.Option(8, min=1, help="requests per batch"),
    input_len: int = typer.Option(32, min=1, help="prompt length in tokens"),
    output_len: int = typer.Option(128, min=1, help="tokens generated per request"),
    num_iters: int = typer.Option(30, min=1, help="timed runs"),
    num_iters_warmup: int = typer.Option(10, min=0, help="untimed runs first"),
    measure_copy_bandwidth_flag: bool = typer.Option(
        True, "--measure-copy-bandwidth/--no-measure-copy-bandwidth",
        help="time a large device copy to compare the decode bandwidth against"),
    output_json: Path | None = typer.Option(None, "--output-json", help="also write the results here"),
    engine_options: dict | None = None,
) -> None:
    """End-to-end latency of one batch (avg and percentiles) and the decode steps' memory bandwidth."""
    from weir.sampling_params import SamplingParams

    engine_options = engine_options or {}
    check_writable(output_json, "--output-json")
    try:
        llm, startup_seconds = start_engine(model, sized_for_workload(model, engine_options, input_len, output_len))
        typer.echo(f"Engine start-up: {startup_seconds:.2f} s")
        check_fits(llm, input_len, output_len)
        rng = random.Random(engine_options.get("seed", 0))
        bound = token_id_bound(llm)
        prompts = [{"prompt_token_ids": [rng.randint(0, bound) for _ in range(input_len)]}
                   for _ in range(batch_size)]
        full_params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
        prefill_params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
        _timed_runs(llm, prompts, full_params, num_iters_warmup, "Warm-up")
        full = _timed_runs(llm, prompts, full_params, num_iters, "Timed")
        prefill = _timed_runs(llm, prompts, prefill_params, num_iters if output_len > 1 else 0, "Prefill-only")
    except ENGINE_ERRORS as error:
        fail(str(error))
    result: dict[str, Any] = {
        "model": model, "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "num_iters": num_iters, "avg_latency_seconds": statistics.fmean(full), "latencies_seconds": full,
        "percentiles_seconds": percentiles(full, LATENCY_PERCENTILES),
        "prefill_latencies_seconds": prefill, "startup_seconds": startup_seconds,
        "engine_options": engine_options,
    }
    typer.echo(f"Avg latency: {result['avg_latency_seconds']:.4f} s")
    for name, value in result["percentiles_seconds"].items():
        typer.echo(f"{name[1:]}% percentile latency: {value:.4f} s")
    result.update(_bandwidth_report(llm, full, prefill, output_len, batch_size, measure_copy_bandwidth_flag))
    if output_json is not None:
        write_json(output_json, result)
