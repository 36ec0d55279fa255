"""``POST /v1/responses``: OpenAI's Responses API over the chat machinery, streamed or not.

The request's input renders through the chat template as a chat completion's messages would
(``ResponsesRequest.messages``), and the reply is split as chat splits it (``--reasoning-parser``,
``--tool-call-parser``) into output items, in the order the model wrote them: ``reasoning``,
``message`` (one ``output_text`` part) and ``function_call`` items. A reply cut by
``max_output_tokens`` makes the response ``incomplete``. Streams send OpenAI's typed events
(``response.created`` ... ``response.completed``), each with its ``sequence_number``; a whole
response is built by the same code fed the whole reply, so both carry the same items.
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weir.outputs import CompletionOutput, RequestOutput
from weir.server.body import parse, read_json
from weir.server.errors import from_value_error
from weir.server.generation import Generation
from weir.server.protocol import ResponsesRequest
from weir.server.reasoning import ReasoningStream
from weir.server.shapes import engine_error, finish_reason
from weir.server.state import ServerState
from weir.server.streaming import EventStreamResponse, final_outputs, sse_event
from weir.server.tool_calls import END as TOOL_CALL_END
from weir.server.tool_calls import ToolCallStream


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(request: Request, state: ServerState) -> Response:
    body = parse(ResponsesRequest, await read_json(request, state.settings))
    state.check_model(body.model)
    settings = state.settings
    body.check_supported(settings.auto_tool_call_parser)
    try:
        params = body.to_sampling_params(state.sampling_defaults)
    except ValueError as error:
        raise from_value_error(error, renamed={"max_tokens": "max_output_tokens"}) from error
    prompt_token_ids = await state.render_chat(body.messages(), template_kwargs=body.template_kwargs(),
                                               tools=body.template_tools(), param="input")
    snapshot = _Snapshot(body, _item_id("resp"), state.served_model_name, state.tokenizer)
    generation = await state.start(prompt_token_ids, None, params, snapshot.response_id, "input",
                                   max_tokens_param="max_output_tokens" if body.max_output_tokens is not None
                                   else None)
    if body.stream:
        return EventStreamResponse(_events(body, snapshot, generation, settings.reasoning_parser),
                                   on_close=generation.close)
    output = await final_outputs(request.receive, generation.final(), generation.close)
    completion = output.outputs[0]
    items = _output_items(body, completion, settings.reasoning_parser)
    return JSONResponse(snapshot.response(items, completion, output))


class _Snapshot:
    """The response object: the same fields in every event, output and status as they stand."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, tokenizer):
        self.body, self.response_id, self.model, self.tokenizer = body, response_id, model, tokenizer
        self.created_at = int(time.time())

    def response(self, items: list[dict], completion: CompletionOutput | None = None,
                 output: RequestOutput | None = None) -> dict:
        """``in_progress`` without a finished ``completion``; else ``completed``, or ``incomplete``
        when the reply ran into max_output_tokens or the context."""
        body = self.body
        reason = finish_reason(completion) if completion is not None else None
        status = "in_progress" if reason is None else ("incomplete" if reason == "length" else "completed")
        response = {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": items, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"}}, "metadata": body.metadata or {}, "store": False,
            "previous_response_id": None, "reasoning": body.reasoning, "truncation": "disabled", "user": body.user,
            "usage": None,
        }
        if output is not None and completion is not None:
            num_prompt, num_output = len(output.prompt_token_ids), len(completion.token_ids)
            # The reasoning text encoded again (its tags left out): the engine does not mark which
            # generated tokens were reasoning, and re-encoding the same text gives the same tokens
            # but for merges across the tag boundary.
            reasoning = "".join(part["text"] for item in items if item["type"] == "reasoning"
                                for part in item["content"])
            num_reasoning = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            response["usage"] = {
                "input_tokens": num_prompt, "output_tokens": num_output, "total_tokens": num_prompt + num_output,
                # cache_write_tokens counts writes to an explicit prompt cache a client pays for;
                # Weir's prefix cache is implicit (its hits are cached_tokens).
                "input_tokens_details": {"cached_tokens": output.num_cached_tokens or 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": min(num_reasoning, num_output)},
            }
        return response


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status, "content": content}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _text_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _ItemBuilder:
    """Turns one reply's text, as it grows, into output items and the stream events that build
    them. Both paths use it (a whole reply is fed once), so streamed and whole responses have
    the same items: reasoning, then text and function calls in the order the model wrote them."""

    def __init__(self, body: ResponsesRequest, reasoning_parser: str | None):
        self.body = body
        self.reasoning = ReasoningStream() if reasoning_parser is not None else None
        self.tools = ToolCallStream() if body.parses_tool_calls else None
        self.items: list[dict] = []
        self.sequence_number = 0
        self.num_calls = 0
        self.open_index: int | None = None  # the reasoning or message item text is flowing into
        self.open_text = ""

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\n" + sse_event(payload)

    def feed(self, delta: str, finished: bool) -> list[bytes]:
        """The events for ``delta`` of the reply's text (all of it when ``finished``)."""
        reasoning, content = self.reasoning.feed(delta, finished) if self.reasoning else ("", delta)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, finished)
        events = self._text("reasoning", reasoning) + self._text("message", content)
        for call in calls:
            if self.body.max_tool_calls is not None and self.num_calls >= self.body.max_tool_calls:
                continue
            self.num_calls += 1
            events += self._close("completed")
            function = call["function"]
            item = {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": function["name"],
                    "arguments": "", "status": "in_progress"}
            index = self._add(item, events)
            item.update(arguments=function["arguments"], status="completed")
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=item["arguments"]))
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, status: str) -> list[bytes]:
        """Close what is open with ``status`` ("completed", or "incomplete" when cut); an empty
        reply still gets its (empty) message."""
        events = [] if self.items else self._open("message")
        return events + self._close(status)

    def _add(self, item: dict, events: list[bytes]) -> int:
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        return index

    def _open(self, kind: str) -> list[bytes]:
        events: list[bytes] = []
        item = (_reasoning_item if kind == "reasoning" else _message_item)(_item_id("rs" if kind == "reasoning"
                                                                                    else "msg"), None, "in_progress")
        index = self._add(item, events)
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=_text_part(kind, "")))
        self.open_index, self.open_text = index, ""
        return events

    def _text(self, kind: str, delta: str) -> list[bytes]:
        if not delta:
            return []
        events: list[bytes] = []
        if self.open_index is None or self.items[self.open_index]["type"] != kind:
            events += self._close("completed") + self._open(kind)
        item = self.items[self.open_index]
        self.open_text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=item["id"], output_index=self.open_index, content_index=0,
                                 delta=delta, **extra))
        return events

    def _close(self, status: str) -> list[bytes]:
        if self.open_index is None:
            return []
        index, text = self.open_index, self.open_text
        item = self.items[index]
        kind = item["type"]
        part = _text_part(kind, text)
        item.update(status=status, content=[part])
        self.open_index, self.open_text = None, ""
        name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [self.event(name, item_id=item["id"], output_index=index, content_index=0, text=text, **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]


def _output_items(body: ResponsesRequest, completion: CompletionOutput, reasoning_parser: str | None) -> list[dict]:
    """A finished reply's items, built as the stream builds them: the text is fed in pieces that
    end where tool-call blocks close, so text after a call lands after it, as streamed."""
    builder = _ItemBuilder(body, reasoning_parser)
    pieces = completion.text.split(TOOL_CALL_END)
    for number, piece in enumerate(pieces):
        last = number == len(pieces) - 1
        builder.feed(piece if last else piece + TOOL_CALL_END, finished=last)
    builder.finish("incomplete" if completion.finish_reason == "length" else "completed")
    return builder.items


async def _events(body: ResponsesRequest, snapshot: _Snapshot, generation: Generation, reasoning_parser: str | None):
    builder = _ItemBuilder(body, reasoning_parser)
    try:
        yield builder.event("response.created", response=snapshot.response([]))
        yield builder.event("response.in_progress", response=snapshot.response([]))
        sent_text, output, completion = "", None, None
        async for output in generation:
            completion = output.outputs[0]
            finished = completion.finish_reason is not None
            delta, sent_text = completion.text[len(sent_text):], completion.text
            for event in builder.feed(delta, finished):
                yield event
        if completion is None:
            return
        for event in builder.finish("incomplete" if completion.finish_reason == "length" else "completed"):
            yield event
        final = snapshot.response(builder.items, completion, output)
        yield builder.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                            response=final)
    except Exception as error:  # headers are sent: the error travels as an event
        api_error = engine_error(error)
        yield builder.event("error", code=api_error.code, message=api_error.message, param=api_error.param)
    finally:
        generation.close()
