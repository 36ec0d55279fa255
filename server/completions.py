"""``POST /v1/completions`` (text or token-id prompts, one or many), streamed or not."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weir.no_tokenizer import has_tokenizer, tokenizer_required_message
from weir.outputs import CompletionOutput
from weir.server.body import parse, read_json
from weir.server.errors import bad_request, from_value_error
from weir.server.generation import Generation, merge
from weir.server.logprobs import completion_logprobs
from weir.server.protocol import CompletionRequest
from weir.server.shapes import ResponseHeader, engine_error, finish_reason, usage
from weir.server.spec_metrics import speculative_metrics
from weir.server.state import ServerState, new_request_id
from weir.server.streaming import DONE_EVENT, EventStreamResponse, final_outputs, sse_event


async def create_completion(request: Request, state: ServerState) -> Response:
    body = parse(CompletionRequest, await read_json(request, state.settings))
    state.check_model(body.model)
    body.check_supported()
    token_ids_only = not has_tokenizer(state.tokenizer)
    if token_ids_only:
        _check_token_ids_only(body)
    try:
        params = body.to_sampling_params(state.sampling_defaults)
    except ValueError as error:
        raise from_value_error(error) from error
    prompts = [await _tokenized(state, prompt, body.echo) for prompt in body.prompts()]
    header = ResponseHeader(new_request_id("cmpl"), "text_completion", state.served_model_name,
                            state.system_fingerprint)
    generations = await state.start_all(prompts, params, header.request_id, "prompt",
                                        max_tokens_param="max_tokens" if body.max_tokens is not None else None)
    echoes = [(text or "") if body.echo else "" for _, text in prompts]

    def close_all() -> None:
        for generation in generations:
            generation.close()

    if body.stream:
        return EventStreamResponse(_events(body, header, generations, echoes, token_ids_only,
                                           state.spec_metrics_level), on_close=close_all)
    outputs = await final_outputs(request.receive, asyncio.gather(*(g.final() for g in generations)), close_all)
    choices, num_prompt_tokens, num_generated, num_cached = [], 0, 0, 0
    for prompt_index, output in enumerate(outputs):
        num_prompt_tokens += len(output.prompt_token_ids)
        num_cached += output.num_cached_tokens or 0
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            logprobs = _logprobs(body, completion, 0, len(echoes[prompt_index]))[0]
            choice = _choice(body, prompt_index, completion, echoes[prompt_index] + completion.text, logprobs,
                             finish_reason(completion))
            if token_ids_only:  # the ids are the completion: its text is empty
                choice["token_ids"] = list(completion.token_ids)
            choices.append(choice)
    metrics = speculative_metrics(state.spec_metrics_level, outputs)
    extra = {} if metrics is None else {"metrics": metrics}
    return JSONResponse(header.body(choices, usage=usage(num_prompt_tokens, num_generated, num_cached), **extra))


def _check_token_ids_only(body: CompletionRequest) -> None:
    """Under skip_tokenizer_init: refuse what needs text, before anything is started."""
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], str)):
        raise bad_request(tokenizer_required_message("a text prompt needs"), param="prompt")
    for name, asked in (("echo", body.echo), ("logprobs", body.logprobs is not None), ("stop", body.stop)):
        if asked:
            raise bad_request(tokenizer_required_message(f"{name} needs"), param=name)


async def _tokenized(state: ServerState, prompt: str | list[int], echo: bool) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
        return await state.encode(prompt), prompt
    vocab_size = state.engine.config.model.vocab_size
    bad = [token_id for token_id in prompt if not 0 <= token_id < vocab_size]
    if bad:
        raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt")
    return prompt, state.decode(prompt) if echo else None


def _choice(body: CompletionRequest, prompt_index: int, completion: CompletionOutput, text: str,
            logprobs: dict | None, reason: str | None) -> dict:
    return {"index": prompt_index * body.n + completion.index, "text": text, "logprobs": logprobs,
            "finish_reason": reason, "stop_reason": completion.stop_reason if reason is not None else None}


def _logprobs(body: CompletionRequest, completion: CompletionOutput, start: int,
              text_offset: int) -> tuple[dict | None, int]:
    if body.logprobs is None:
        return None, text_offset
    end = len(completion.token_ids)  # the engine appends to the logprobs list as it goes
    return completion_logprobs(completion.token_ids[start:end], completion.logprobs[start:end], text_offset)


async def _events(body: CompletionRequest, header: ResponseHeader, generations: list[Generation],
                  echoes: list[str], token_ids_only: bool = False, spec_metrics_level: str = "none"):
    extra = {"usage": None} if body.include_usage else {}
    # Per choice (prompt index, completion index): text and tokens sent, text offset, done.
    sent_text: dict[tuple[int, int], str] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    offsets: dict[tuple[int, int], int] = {}
    done: set[tuple[int, int]] = set()
    last_outputs: dict[int, object] = {}

    def chunk(prompt_index, completion, text, logprobs=None, reason=None, new_token_ids=None, metrics=None) -> bytes:
        choice = _choice(body, prompt_index, completion, text, logprobs, reason)
        if new_token_ids is not None:
            choice["token_ids"] = new_token_ids
        return sse_event(header.body([choice], **extra, **({} if metrics is None else {"metrics": metrics})))

    def final_metrics() -> dict | None:
        return speculative_metrics(spec_metrics_level, [last_outputs[index] for index in sorted(last_outputs)])

    num_choices = len(generations) * body.n

    try:
        async for prompt_index, output in merge(generations):
            last_outputs[prompt_index] = output
            for completion in output.outputs:
                key = (prompt_index, completion.index)
                if key in done:
                    continue
                if key not in sent_text:
                    sent_text[key], sent_tokens[key] = "", 0
                    offsets[key] = len(echoes[prompt_index])
                    if echoes[prompt_index]:
                        yield chunk(prompt_index, completion, echoes[prompt_index])
                delta_text = completion.text[len(sent_text[key]):]
                num_tokens = len(completion.token_ids)
                if token_ids_only and num_tokens > sent_tokens[key]:  # no text: the new ids are the delta
                    yield chunk(prompt_index, completion, "",
                                new_token_ids=list(completion.token_ids[sent_tokens[key]:num_tokens]))
                    sent_tokens[key] = num_tokens
                elif delta_text or (num_tokens > sent_tokens[key]
                                    and (completion.finish_reason is None or body.logprobs is not None)):
                    # Tokens with no text yet (special tokens, bytes of an unfinished character)
                    # still get their chunk, as vLLM sends it: the client sees the stream move
                    # and can time its first token. A final step's is left to the closing chunk.
                    logprobs, offsets[key] = _logprobs(body, completion, sent_tokens[key], offsets[key])
                    yield chunk(prompt_index, completion, delta_text, logprobs)
                    sent_text[key], sent_tokens[key] = completion.text, num_tokens
                if completion.finish_reason is not None:
                    done.add(key)
                    # The response's metrics ride on its final chunk: this one, unless usage follows.
                    last = len(done) == num_choices and not body.include_usage
                    yield chunk(prompt_index, completion, "", reason=finish_reason(completion),
                                metrics=final_metrics() if last else None)
        if body.include_usage:
            outputs = [last_outputs[index] for index in sorted(last_outputs)]
            num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
            num_generated = sum(len(c.token_ids) for output in outputs for c in output.outputs)
            num_cached = sum(output.num_cached_tokens or 0 for output in outputs)
            metrics = final_metrics()
            yield sse_event(header.body([], usage=usage(num_prompt_tokens, num_generated, num_cached),
                                        **({} if metrics is None else {"metrics": metrics})))
    except Exception as error:  # headers are sent: the error travels as an event
        yield sse_event(engine_error(error).body())
    finally:
        for generation in generations:
            generation.close()
    yield DONE_EVENT
