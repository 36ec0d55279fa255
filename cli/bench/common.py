"""Helpers the ``weir bench`` commands share: engine start-up, warm-up, errors, JSON output."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NoReturn

import typer

# Errors the engine raises for bad input or an unusable setup: shown as one line, not a traceback.
ENGINE_ERRORS = (ValueError, RuntimeError, FileNotFoundError)

# Prompt token ids are drawn from [0, PROMPT_TOKEN_ID_BOUND] inclusive, as the nano-vllm benchmark
# does, so the workloads match it token for token; small vocabularies lower the bound.
PROMPT_TOKEN_ID_BOUND = 10000


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def start_engine(model: str, engine_options: dict[str, Any]) -> tuple[Any, float]:
    """``(LLM, start-up seconds)``: the time from nothing to an engine ready to take requests."""
    from weir.llm import LLM

    start = time.perf_counter()
    llm = LLM(model, **engine_options)
    return llm, time.perf_counter() - start


def token_id_bound(llm: Any) -> int:
    return min(PROMPT_TOKEN_ID_BOUND, llm.engine.model_config.vocab_size - 1)


# warm_up's longest request: its context must fit too.
WARM_UP_PROMPT_LEN, WARM_UP_MAX_TOKENS = 16, 8


def warm_up(llm: Any) -> None:
    """Two short requests, so first-call costs (allocator growth, kernel selection, lazy
    compilation) stay out of the timed run."""
    from weir.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": list(range(1, WARM_UP_PROMPT_LEN + 1))},
               {"prompt_token_ids": list(range(17, 25))}]
    llm.generate(prompts, SamplingParams(max_tokens=WARM_UP_MAX_TOKENS, ignore_eos=True), use_tqdm=False)


def check_fits(llm: Any, longest_prompt: int, longest_output: int) -> None:
    max_model_len = llm.engine.config.scheduler.max_model_len
    if longest_prompt + longest_output > max_model_len:
        raise ValueError(f"prompts of up to {longest_prompt} tokens plus {longest_output} output tokens exceed "
                         f"max_model_len={max_model_len}; raise --max-model-len or shorten the lengths")


def check_writable(path: Path | None, option: str) -> None:
    """Refuse an output path that cannot be written before the run, not after it."""
    if path is None:
        return
    if path.is_dir():
        fail(f"{option} {path} is a directory; give a file path")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        fail(f"{option} {path}: cannot create {parent}: {error.strerror or error}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"{option} {path} is not writable")


def _finite(value: Any) -> Any:
    """NaN (a statistic of no samples) as null: strict JSON has no NaN."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    text = json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as error:  # the run is over: keep its results on stdout
        typer.echo(text)
        fail(f"cannot write {path}: {error.strerror or error} (the results are printed above)")
    typer.echo(f"wrote {path}")


def percentiles(values: list[float], points: tuple[int, ...]) -> dict[str, float]:
    """``{"p10": ..., ...}`` by linear interpolation (numpy's default)."""
    import numpy as np

    if not values:
        return {f"p{point}": float("nan") for point in points}
    return {f"p{point}": float(value) for point, value in zip(points, np.percentile(values, points))}


def human_bytes(num_bytes: float) -> str:
    """``16.38 GB``, ``476.9 kB``: decimal units, as bandwidth figures are quoted."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def sized_for_workload(model: str, engine_options: dict[str, Any], longest_prompt: int,
                       longest_output: int) -> dict[str, Any]:
    """Engine options for a benchmark whose requests are known before the engine starts, where
    the user set none: a context of the longest prompt plus the longest output (the model's own
    is often far longer, 40,960 tokens for Qwen3, which a CPU's KV cache cannot hold for even one
    request), and no tokenizer when the model has no tokenizer files (the workloads are token
    ids; ``skip_tokenizer_init``)."""
    from weir.model_files import has_tokenizer_files, model_context_length

    options = dict(engine_options)
    if "max_model_len" not in options:
        longest = max(longest_prompt + longest_output, WARM_UP_PROMPT_LEN + WARM_UP_MAX_TOKENS)
        options["max_model_len"] = min(longest, model_context_length(model))
    if "skip_tokenizer_init" not in options and "tokenizer" not in options and not has_tokenizer_files(model):
        typer.echo(f"{model} has no tokenizer files: running on token ids alone (skip_tokenizer_init)")
        options["skip_tokenizer_init"] = True
    return options
