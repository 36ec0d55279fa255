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
from weir.cli.bench.serve_report import (latency_samples, per_request_details, plot_latencies, print_summary,
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
    save_result: bool = typer.Option(False, "--save-result", help="write the results as JSON (vLLM's key "
                                     "names), plus a PNG plot of the latency distributions beside it"),
    save_detailed: bool = typer.Option(False, "--save-detailed", help="with --save-result: also each "
                                       "request's lengths, TTFT, ITLs, latency and error"),
    result_dir: Path | None = typer.Option(None, help="folder of the --save-result file (default: here)"),
    result_filename: str | None = typer.Option(None, help="name of the --save-result file (default: "
                                               "LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json, as vLLM)"),
    label: str | None = typer.Option(None, help="prefix of the default result file name (default: openai, "
                                     "or openai-chat for /v1/chat/completions)"),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="with --save-result: draw the PNG (matplotlib)"),
) -> None:
    """Benchmark a running OpenAI-compatible server with streaming requests."""
    started = datetime.datetime.now()
    try:
        rate = parse_request_rate(request_rate)
        if endpoint not in _ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(_ENDPOINTS)}, got {endpoint!r}")
        if not save_result and (result_dir or result_filename or save_detailed):
            raise ValueError("--result-dir, --result-filename and --save-detailed need --save-result")
        http_module()  # no HTTP client: say so now, not after the run is set up
        if save_result and plot:
            require_matplotlib()
    except (ValueError, RuntimeError) as error:
        fail(str(error))
    backend = "openai-chat" if endpoint == "/v1/chat/completions" else "openai"
    try:
        served_model = model or asyncio.run(first_model_name(base_url, timeout))
    except RuntimeError as error:
        fail(str(error))
    except Exception as error:  # noqa: BLE001 - connection failures of any HTTP library
        fail(f"cannot reach {base_url}: {type(error).__name__}: {error}")
    result_path = None
    if save_result:
        result_path = result_file_path(result_dir, result_filename, label or backend, rate, max_concurrency,
                                       served_model, started)
        check_writable(result_path, "--save-result")
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
    if result_path is not None:
        record = {
            "date": started.strftime("%Y%m%d-%H%M%S"), "backend": backend, "label": label or backend,
            "model_id": served_model, "tokenizer_id": None, "num_prompts": num_prompts,
            "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": 1.0,
            "max_concurrency": max_concurrency, "base_url": base_url, "seed": seed,
            **dataclasses.asdict(workload), **summary,
        }
        if save_detailed:
            record.update(per_request_details(results))
        write_json(result_path, record)
        if plot:
            plot_path = result_path.with_suffix(".png")
            plot_latencies(latency_samples(results), plot_path,
                           f"{served_model} at {base_url}: {num_prompts} requests, rate {request_rate}")
            typer.echo(f"wrote {plot_path}")
    if summary["completed"] == 0:
        fail("every request failed")


def result_file_path(result_dir: Path | None, result_filename: str | None, label: str, rate: float,
                     max_concurrency: int | None, served_model: str, started: datetime.datetime) -> Path:
    """Where --save-result writes: vLLM's default name, or the one given, in --result-dir."""
    if result_filename is None:
        concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
        base_model = served_model.rstrip("/").split("/")[-1]
        result_filename = f"{label}-{rate}qps{concurrency}-{base_model}-{started.strftime('%Y%m%d-%H%M%S')}.json"
    return (result_dir or Path(".")) / result_filename
