"""``weir generate``: one prompt through the engine, printed as it is generated."""

from __future__ import annotations

import logging
import sys
import time

import typer

from weir.cli.engine_options import with_engine_options

# Tokens a chat template may add around one user message (role markers, a default system prompt):
# generous, since the text is not tokenized before the engine starts.
TEMPLATE_ALLOWANCE_TOKENS = 1024


def sized_for_one_prompt(model: str | None, prompt: str, max_tokens: int, engine_options: dict) -> dict:
    """Engine options sized to this one request, where the user set none: one sequence, and a
    context of the prompt (at most one token per UTF-8 byte, plus the chat template's allowance)
    and its output. The KV cache then holds what this request can use, not the platform's default
    (4 GiB zeroed on the CPU for a two-word prompt); max_model_len never exceeds the model's own."""
    from weir.model_files import model_context_length

    options = dict(engine_options)
    options.setdefault("max_num_seqs", 1)
    if "max_model_len" not in options:
        wanted = len(prompt.encode()) + TEMPLATE_ALLOWANCE_TOKENS + max_tokens
        options["max_model_len"] = min(wanted, model_context_length(model))
    return options


@with_engine_options
def generate(
    prompt: str = typer.Argument(..., help="the prompt"),
    model: str | None = typer.Option(None, "--model", "-m",
                                     help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct)"),
    max_tokens: int = typer.Option(128, help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    sampling_seed: int | None = typer.Option(None, "--sampling-seed", help="seed of this request's sampling"),
    chat: bool = typer.Option(True, "--chat/--raw", help="apply the model's chat template"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="log engine start-up"),
    engine_options: dict | None = None,
) -> None:
    """Generate a completion for PROMPT (with the chat template unless --raw)."""
    from weir.llm import LLM
    from weir.sampling_params import SamplingParams

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=sampling_seed)
        llm = LLM(model, **sized_for_one_prompt(model, prompt, max_tokens, engine_options or {}))
        start = time.perf_counter()
        if chat:
            output = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        else:
            output = llm.generate(prompt, params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    completion = output.outputs[0]
    typer.echo(completion.text)
    num_tokens = len(completion.token_ids)
    print(f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tok/s, "
          f"finish_reason={completion.finish_reason}]", file=sys.stderr)
