"""``weir bench throughput``: offline batch throughput over random token-id prompts.

The random workload is the nano-vllm benchmark's: ``random.seed(seed)``, then for each prompt its
length and token ids, then each request's ``max_tokens``, all uniform (inclusive) in the ranges.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import typer

from weir.cli.bench.common import (ENGINE_ERRORS, check_fits, check_writable, fail, start_engine,
                                   sized_for_workload, token_id_bound, warm_up, write_json)
from weir.cli.engine_options import with_engine_options


def parse_random_range(text: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``"IMIN:IMAX,OMIN:OMAX"`` -> ((IMIN, IMAX), (OMIN, OMAX)); ValueError naming the flag."""
    try:
        input_part, output_part = text.split(",")
        ranges = tuple(tuple(int(bound) for bound in part.split(":")) for part in (input_part, output_part))
        if any(len(bounds) != 2 for bounds in ranges):
            raise ValueError
    except ValueError:
        raise ValueError(f"--random-range must look like IMIN:IMAX,OMIN:OMAX (e.g. 100:1024,100:1024), "
                         f"got {text!r}") from None
    for name, (low, high) in zip(("input", "output"), ranges):
        if not 1 <= low <= high:
            raise ValueError(f"--random-range {name} range {low}:{high} must satisfy 1 <= min <= max")
    return ranges  # type: ignore[return-value]


def random_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    seed: int, max_token_id: int) -> tuple[list[list[int]], list[int]]:
    """``(prompt token ids, max_tokens)`` per request, drawn in the nano-vllm benchmark's order."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(*input_range))]
               for _ in range(num_prompts)]
    max_tokens = [rng.randint(*output_range) for _ in range(num_prompts)]
    return prompts, max_tokens


def kv_cache_summary(llm) -> dict:
    """What the KV cache held: tokens every group fits at once, each group's usable blocks, and
    how often requests were preempted for lack of them."""
    scheduler = llm.engine.scheduler
    groups = [{"sliding_window": group.sliding_window, "usable_blocks": pool.num_usable_blocks}
              for group, pool in zip(scheduler.kv_cache.groups, scheduler.kv_cache.pools)]
    return {"kv_cache_tokens": scheduler.kv_cache.capacity_tokens, "kv_cache_groups": groups,
            "num_preemptions": scheduler.num_preemptions}


def _lengths(input_len: int | None, output_len: int | None,
             random_range: str | None) -> tuple[tuple[int, int], tuple[int, int]]:
    if random_range is not None:
        if input_len is not None or output_len is not None:
            raise ValueError("pass either --input-len/--output-len or --random-range, not both")
        return parse_random_range(random_range)
    if input_len is None or output_len is None:
        raise ValueError("pass --input-len and --output-len (fixed lengths) or --random-range "
                         "IMIN:IMAX,OMIN:OMAX (uniform lengths)")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {input_len} and {output_len}")
    return (input_len, input_len), (output_len, output_len)


@with_engine_options
def throughput(
    model: str = typer.Argument(..., help="checkpoint folder or .gguf file; with --load-format dummy, "
                                          "a folder holding config.json suffices"),
    num_prompts: int = typer.Option(256, min=1, help="requests in the run"),
    input_len: int | None = typer.Option(None, help="prompt length in tokens (fixed)"),
    output_len: int | None = typer.Option(None, help="output length in tokens (fixed)"),
    random_range: str | None = typer.Option(
        None, help="IMIN:IMAX,OMIN:OMAX: prompt and output lengths uniform in these ranges (seeded by --seed)"),
    temperature: float = typer.Option(0.6, help="sampling temperature"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help="generate every requested token, past end-of-sequence"),
    output_json: Path | None = typer.Option(None, "--output-json", help="also write the results here"),
    engine_options: dict | None = None,
) -> None:
    """Requests/s and tokens/s of one batch of random-token prompts through the offline engine."""
    from weir.sampling_params import SamplingParams

    engine_options = engine_options or {}
    check_writable(output_json, "--output-json")
    try:
        input_range, output_range = _lengths(input_len, output_len, random_range)
        llm, startup_seconds = start_engine(model, sized_for_workload(model, engine_options, input_range[1],
                                                                       output_range[1]))
        typer.echo(f"Engine start-up: {startup_seconds:.2f} s")
        check_fits(llm, input_range[1], output_range[1])
        prompts, max_tokens = random_workload(num_prompts, input_range, output_range,
                                              engine_options.get("seed", 0), token_id_bound(llm))
        params = [SamplingParams(temperature=temperature, ignore_eos=ignore_eos, max_tokens=tokens)
                  for tokens in max_tokens]
        warm_up(llm)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    except ENGINE_ERRORS as error:
        fail(str(error))
    prompt_tokens = sum(len(ids) for ids in prompts)
    output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    result = {
        "model": model, "num_requests": num_prompts, "elapsed_seconds": elapsed,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "requests_per_second": num_prompts / elapsed,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "startup_seconds": startup_seconds,
        "input_range": list(input_range), "output_range": list(output_range),
        "temperature": temperature, "ignore_eos": ignore_eos, "engine_options": engine_options,
        **kv_cache_summary(llm),
    }
    typer.echo(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
               f"{result['total_tokens_per_second']:.2f} total tokens/s, "
               f"{result['output_tokens_per_second']:.2f} output tokens/s")
    typer.echo(f"({num_prompts} requests, {prompt_tokens} prompt + {output_tokens} output tokens "
               f"in {elapsed:.2f} s)")
    if output_json is not None:
        write_json(output_json, result)
