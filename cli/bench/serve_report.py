"""Metrics of a ``weir bench serve`` run: summary, printout, JSON and the latency plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import typer

from weir.cli.bench.common import percentiles
from weir.cli.bench.serve_client import RequestResult

# name -> what it measures, in milliseconds
LATENCY_METRICS = {
    "ttft": "time to first token",
    "tpot": "time per output token, excluding the first",
    "itl": "inter-token latency",
    "e2el": "end-to-end request latency",
}


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-metric samples in milliseconds, from the successful requests."""
    done = [result for result in results if result.success]
    return {
        "ttft": [result.ttft * 1e3 for result in done],
        "tpot": [(result.e2e - result.ttft) * 1e3 / (result.output_tokens - 1)
                 for result in done if result.output_tokens > 1],
        "itl": [gap * 1e3 for result in done for gap in result.itl],
        "e2el": [result.e2e * 1e3 for result in done],
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The run's figures under the key names of vLLM's ``bench serve`` result JSON."""
    done = [result for result in results if result.success]
    output_tokens = sum(result.output_tokens for result in done)
    prompt_tokens = sum(result.prompt_tokens for result in done)
    summary: dict[str, Any] = {
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "output_tokens_estimated": any(result.output_tokens_estimated for result in done),
    }
    for name, samples in latency_samples(results).items():
        summary[f"mean_{name}_ms"] = statistics.fmean(samples) if samples else float("nan")
        summary[f"median_{name}_ms"] = statistics.median(samples) if samples else float("nan")
        summary[f"std_{name}_ms"] = statistics.pstdev(samples) if samples else float("nan")
        summary[f"p99_{name}_ms"] = percentiles(samples, (99,))["p99"]
    return summary


def per_request_details(results: list[RequestResult]) -> dict[str, list]:
    """vLLM's per-request lists (``--save-detailed``), in request order, seconds as vLLM keeps them."""
    return {
        "input_lens": [result.prompt_tokens for result in results],
        "output_lens": [result.output_tokens for result in results],
        "ttfts": [result.ttft for result in results],
        "itls": [result.itl for result in results],
        "latencies": [result.e2e for result in results],
        "errors": [result.error for result in results],
    }


def print_summary(summary: dict[str, Any], errors: list[str]) -> None:
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration']:.2f}"),
        ("Total prompt tokens", f"{summary['total_input_tokens']}"),
        ("Total output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for name, meaning in LATENCY_METRICS.items():
        for statistic in ("mean", "median", "p99"):
            value = summary[f"{statistic}_{name}_ms"]
            rows.append((f"{statistic.capitalize()} {name.upper()} (ms)", f"{value:.2f}"))
    typer.echo("=" * 18 + " Serving benchmark result " + "=" * 18)
    for label, value in rows:
        typer.echo(f"{label:<40}{value:>22}")
    typer.echo("=" * 62)
    if summary["output_tokens_estimated"]:
        typer.echo("note: the server sent no token usage, so output tokens (and TPOT, throughput) count "
                   "stream chunks; a chunk may hold several tokens", err=True)
    for error in sorted(set(errors))[:5]:
        typer.echo(f"failure: {error}", err=True)


def require_matplotlib() -> None:
    """Fail before any request is sent when the plot could not be drawn afterwards."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--save-result draws a PNG plot with matplotlib, which is not installed: "
                           "pip install 'weir-engine[bench]' (or pip install matplotlib)") from None


def plot_latencies(samples: dict[str, list[float]], path: Path, title: str) -> None:
    """One histogram per latency metric, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (name, meaning) in zip(axes.flat, LATENCY_METRICS.items()):
        values = samples[name]
        if values:
            axis.hist(values, bins=min(50, max(5, len(values) // 4)), color="#3b7dd8")
            axis.axvline(statistics.median(values), color="black", linestyle="--", label="median")
            axis.axvline(percentiles(values, (99,))["p99"], color="red", linestyle=":", label="p99")
            axis.legend()
        axis.set_title(f"{name.upper()}: {meaning}", fontsize=10)
        axis.set_xlabel("ms")
        axis.set_ylabel("count")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
