"""``weir bench serve``: load an OpenAI-compatible server (Weir's, vLLM's, any) with streaming
requests and report TTFT, TPOT, ITL, end-to-end latency and throughput."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
from pathlib import Path

import typer

from weir.cli.bench.common import check_writable, fail, write_json
from weir.cli.bench.serve_client import Workload, build_payloads, first_model_name, http_module, run_requests
from weir.cli.bench.serve_report import (latency_samples, plot_latencies, print_summary,
                                         require_matplotlib, summarize)

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def parse_request_rate(text: str) -> float:
    """``inf`` or a positive number of requests per second."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"--request-rate must be 'inf' or a positive number of requests/s, got {text!r}")
    return rate


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Requests", unit="req")


def serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", help="the server's root URL"),
    model: str | None = typer.Option(None, help="model name sent in requests (default: the first at /v1/models)"),
    endpoint: str = typer.Option("/v1/completions", help="/v1/completions or /v1/chat/completions"),
    num_prompts: int = typer.Option(1000, min=1, help="requests to send"),
    request_rate: str = typer.Option("inf", help="'inf' (all at once) or requests/s, with Poisson arrivals"),
    max_concurrency: int | None = typer.Option(None, min=1, help="requests in flight at most"),
    random_input_len: int = typer.Option(1024, min=1, help="prompt length in tokens"),
    random_output_len: int = typer.Option(128, min=1, help="max_tokens of each request"),
    seed: int = typer.Option(0, help="seeds the prompts and the arrival times"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos/--no-ignore-eos",
                                    help="ask the server to generate past end-of-sequence"),
    temperature: float = typer.Option(0.0, help="sampling temperature sent with each request"),
    token_ids: bool = typer.Option(True, "--token-ids/--text",
                                   help="/v1/completions prompts as token ids (exact lengths) or as text"),
    timeout: float = typer.Option(3600.0, min=1, help="seconds a request may wait on the server"),
    save_result: Path | None = typer.Option(None, help="write the results as JSON here, plus a PNG "
                                                       "plot of the latency distributions beside it"),
) -> None:
    """Benchmark a running OpenAI-compatible server with streaming requests."""
    check_writable(save_result, "--save-result")
    try:
        rate = parse_request_rate(request_rate)
        if endpoint not in _ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(_ENDPOINTS)}, got {endpoint!r}")
        http_module()  # no HTTP client: say so now, not after the run is set up
        if save_result is not None:
            require_matplotlib()
        served_model = model or asyncio.run(first_model_name(base_url, timeout))
    except (ValueError, RuntimeError) as error:
        fail(str(error))
    except Exception as error:  # noqa: BLE001 - connection failures of any HTTP library
        fail(f"cannot reach {base_url}: {type(error).__name__}: {error}")
    workload = Workload(endpoint, served_model, random_input_len, random_output_len, ignore_eos,
                        temperature, token_ids)
    payloads = build_payloads(workload, num_prompts, seed)
    typer.echo(f"{num_prompts} requests to {base_url}{endpoint} (model {served_model}), rate {rate}/s, "
               f"max concurrency {max_concurrency or 'unbounded'}")
    with _progress_bar(num_prompts) as bar:
        results, duration = asyncio.run(run_requests(base_url, workload, payloads, rate, max_concurrency,
                                                     seed, timeout, lambda: bar.update(1)))
    summary = summarize(results, duration)
    print_summary(summary, [result.error for result in results if not result.success])
    if save_result is not None:
        samples = latency_samples(results)
        record = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "base_url": base_url, "num_prompts": num_prompts, "request_rate": request_rate,
            "max_concurrency": max_concurrency, "seed": seed, **dataclasses.asdict(workload),
            **summary, "samples_ms": samples,
            "output_tokens": [result.output_tokens for result in results],
            "errors": [result.error for result in results if not result.success],
        }
        write_json(save_result, record)
        plot_path = save_result.with_suffix(".png")
        plot_latencies(samples, plot_path, f"{served_model} at {base_url}: {num_prompts} requests, "
                                           f"rate {request_rate}")
        typer.echo(f"wrote {plot_path}")
    if summary["successful_requests"] == 0:
        fail("every request failed")
