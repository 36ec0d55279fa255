"""``POST /v1/chat/completions``, streamed or not."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weir.outputs import CompletionOutput, RequestOutput
from weir.server.body import parse, read_json
from weir.server.errors import from_value_error
from weir.server.generation import Generation
from weir.server.logprobs import TokenBytes, chat_logprobs
from weir.server.protocol import ChatCompletionRequest, template_kwargs
from weir.server.reasoning import ReasoningStream, parse_reasoning
from weir.server.shapes import ResponseHeader, engine_error, finish_reason, usage
from weir.server.spec_metrics import speculative_metrics
from weir.server.state import ServerState, new_request_id
from weir.server.streaming import DONE_EVENT, EventStreamResponse, final_outputs, sse_event
from weir.server.tool_calls import ToolCallStream, parse_tool_calls


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    chat = parse(ChatCompletionRequest, await read_json(request, state.settings))
    state.check_model(chat.model)
    settings = state.settings
    chat.check_supported(settings.auto_tool_call_parser)
    try:
        params = chat.to_sampling_params(state.sampling_defaults)
    except ValueError as error:
        renamed = {"logprobs": "top_logprobs"}
        if chat.max_completion_tokens is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        raise from_value_error(error, renamed=renamed) from error
    messages = [message.as_template_message(index) for index, message in enumerate(chat.messages)]
    prompt_token_ids = await state.render_chat(messages, chat.add_generation_prompt, chat.continue_final_message,
                                               template_kwargs(chat), chat.tools)
    header = ResponseHeader(new_request_id("chatcmpl"), "chat.completion", state.served_model_name,
                            state.system_fingerprint)
    explicit_max = ("max_completion_tokens" if chat.max_completion_tokens is not None
                    else "max_tokens" if chat.max_tokens is not None else None)
    generation = await state.start(prompt_token_ids, None, params, header.request_id, "messages",
                                   max_tokens_param=explicit_max)
    if chat.stream:
        header.object = "chat.completion.chunk"
        events = _events(chat, header, generation, state.token_bytes, settings.reasoning_parser,
                         state.spec_metrics_level)
        return EventStreamResponse(events, on_close=generation.close)
    output = await final_outputs(request.receive, generation.final(), generation.close)
    body = _response_body(chat, header, output, state.token_bytes, settings.reasoning_parser)
    metrics = speculative_metrics(state.spec_metrics_level, [output])
    if metrics is not None:
        body["metrics"] = metrics
    return JSONResponse(body)


def _logprobs(chat: ChatCompletionRequest, completion: CompletionOutput, start: int,
              token_bytes: TokenBytes) -> dict | None:
    if not chat.logprobs:
        return None
    end = len(completion.token_ids)  # the engine appends to the logprobs list as it goes
    content = chat_logprobs(completion.token_ids[start:end], completion.logprobs[start:end],
                            chat.top_logprobs or 0, token_bytes)
    return {"content": content, "refusal": None}


def _choice_reason(completion: CompletionOutput, called_tools: bool) -> str | None:
    """OpenAI's reason, ``tool_calls`` when the model stopped after calling tools."""
    reason = finish_reason(completion)
    return "tool_calls" if called_tools and reason == "stop" else reason


def _message(chat: ChatCompletionRequest, completion: CompletionOutput, reasoning_parser: str | None) -> dict:
    """The assistant message: reasoning, content and tool calls, as the server is set up to split them."""
    content = completion.text
    message = {"role": "assistant", "content": content, "refusal": None}
    if reasoning_parser is not None:
        message["reasoning_content"], content = parse_reasoning(content)
        message["content"] = content
    if chat.parses_tool_calls:
        without_calls, calls = parse_tool_calls(content or "")
        if calls:
            message["content"] = without_calls
        message["tool_calls"] = calls[:chat.max_tool_calls]
    return message


class _ReplySplitter:
    """One streamed choice's text split as ``_message`` splits a whole one: reasoning first, then
    content, with tool calls taken out of the content."""

    def __init__(self, chat: ChatCompletionRequest, reasoning_parser: str | None):
        self.reasoning = ReasoningStream() if reasoning_parser is not None else None
        self.tools = ToolCallStream() if chat.parses_tool_calls else None
        self.max_calls = chat.max_tool_calls

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def feed(self, text: str, finished: bool) -> dict:
        """The delta to send for ``text`` (``content`` always present, possibly "")."""
        reasoning, content = self.reasoning.feed(text, finished) if self.reasoning else ("", text)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, finished)
            calls = [call for call in calls if self.max_calls is None or call["index"] < self.max_calls]
        delta = {"content": content}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = calls
        return delta


def _response_body(chat: ChatCompletionRequest, header: ResponseHeader, output: RequestOutput,
                   token_bytes: TokenBytes, reasoning_parser: str | None) -> dict:
    choices = []
    for completion in output.outputs:
        message = _message(chat, completion, reasoning_parser)
        choices.append({
            "index": completion.index,
            "message": message,
            "logprobs": _logprobs(chat, completion, 0, token_bytes),
            "finish_reason": _choice_reason(completion, bool(message.get("tool_calls"))),
            "stop_reason": completion.stop_reason,
        })
    num_generated = sum(len(completion.token_ids) for completion in output.outputs)
    return header.body(choices, usage=usage(len(output.prompt_token_ids), num_generated,
                                            output.num_cached_tokens or 0))


async def _events(chat: ChatCompletionRequest, header: ResponseHeader, generation: Generation,
                  token_bytes: TokenBytes, reasoning_parser: str | None, spec_metrics_level: str = "none"):
    extra = {"usage": None} if chat.include_usage else {}

    def chunk(index: int, delta: dict, logprobs: dict | None = None, reason: str | None = None,
              stop_reason: int | str | None = None, metrics: dict | None = None) -> bytes:
        more = {} if metrics is None else {"metrics": metrics}
        return sse_event(header.body([{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": reason, "stop_reason": stop_reason}], **extra, **more))

    num_choices = chat.n
    sent_text, sent_tokens, done = [""] * num_choices, [0] * num_choices, [False] * num_choices
    splitters = [_ReplySplitter(chat, reasoning_parser) for _ in range(num_choices)]
    try:
        for index in range(num_choices):
            yield chunk(index, {"role": "assistant", "content": ""})
        output = None
        async for output in generation:
            for completion in output.outputs:
                index = completion.index
                if done[index]:
                    continue
                finished = completion.finish_reason is not None
                delta = splitters[index].feed(completion.text[len(sent_text[index]):], finished)
                num_tokens = len(completion.token_ids)
                # New tokens with no text yet still get their chunk (see completions.py).
                if delta["content"] or len(delta) > 1 or (num_tokens > sent_tokens[index]
                                                          and (not finished or chat.logprobs)):
                    logprobs = _logprobs(chat, completion, sent_tokens[index], token_bytes)
                    yield chunk(index, delta, logprobs)
                sent_text[index], sent_tokens[index] = completion.text, num_tokens
                if finished:
                    done[index] = True
                    # The response's metrics ride on its final chunk: this one, unless usage follows.
                    last = all(done) and not chat.include_usage
                    yield chunk(index, {}, reason=_choice_reason(completion, splitters[index].called_tools),
                                stop_reason=completion.stop_reason,
                                metrics=speculative_metrics(spec_metrics_level, [output]) if last else None)
        if chat.include_usage and output is not None:
            num_generated = sum(len(completion.token_ids) for completion in output.outputs)
            metrics = speculative_metrics(spec_metrics_level, [output])
            yield sse_event(header.body([], usage=usage(len(output.prompt_token_ids), num_generated,
                                                        output.num_cached_tokens or 0),
                                        **({} if metrics is None else {"metrics": metrics})))
    except Exception as error:  # headers are sent: the error travels as an event
        yield sse_event(engine_error(error).body())
    finally:
        generation.close()
    yield DONE_EVENT
