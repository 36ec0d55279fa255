"""``POST /v1/responses``: OpenAI's Responses API over the chat machinery, streamed or not.

The request's input renders through the chat template as a chat completion's messages would
(``ResponsesRequest.messages``), and the reply is split as chat splits it (``--reasoning-parser``,
``--tool-call-parser``) into output items: a ``reasoning`` item, a ``message`` with one
``output_text`` part, then one ``function_call`` item per call. A reply cut by
``max_output_tokens`` makes the response ``incomplete``. Streams send OpenAI's typed events
(``response.created`` ... ``response.completed``), each with its ``sequence_number``.
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
from weir.server.reasoning import ReasoningStream, parse_reasoning
from weir.server.shapes import engine_error, finish_reason
from weir.server.state import ServerState
from weir.server.streaming import EventStreamResponse, final_outputs, sse_event
from weir.server.tool_calls import ToolCallStream, parse_tool_calls


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(request: Request, state: ServerState) -> Response:
    body = parse(ResponsesRequest, await read_json(request, state.settings.max_request_body_bytes))
    state.check_model(body.model)
    settings = state.settings
    body.check_supported(settings.tool_call_parser if settings.enable_auto_tool_choice else None)
    try:
        params = body.to_sampling_params(state.sampling_defaults)
    except ValueError as error:
        raise from_value_error(error, renamed={"max_tokens": "max_output_tokens"}) from error
    prompt_token_ids = await state.render_chat(body.messages(), template_kwargs=body.template_kwargs(),
                                               tools=body.template_tools())
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
                "input_tokens_details": {"cached_tokens": output.num_cached_tokens or 0},
                "output_tokens_details": {"reasoning_tokens": min(num_reasoning, num_output)},
            }
        return response


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(call: dict, status: str = "completed") -> dict:
    """A chat-style tool call (``weir.server.tool_calls``) as a Responses ``function_call`` item."""
    function = call["function"]
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": status}


def _output_items(body: ResponsesRequest, completion: CompletionOutput, reasoning_parser: str | None) -> list[dict]:
    """A finished reply's items: reasoning, message, function calls (each only when present)."""
    reasoning, content = (parse_reasoning(completion.text) if reasoning_parser is not None
                          else (None, completion.text))
    calls = []
    if body.parses_tool_calls:
        content, calls = parse_tool_calls(content or "")
        calls = calls[:body.max_tool_calls]
    status = "incomplete" if completion.finish_reason == "length" else "completed"
    items = []
    if reasoning:
        items.append(_reasoning_item(_item_id("rs"), reasoning, status))
    if content or not calls:
        items.append(_message_item(_item_id("msg"), content or "", status))
    items.extend(_call_item(call) for call in calls)
    return items


class _EventWriter:
    """Numbers the events and keeps the output items as they stand, for the final snapshot."""

    def __init__(self, snapshot: _Snapshot):
        self.snapshot = snapshot
        self.sequence_number = 0
        self.items: list[dict] = []

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\n" + sse_event(payload)

    def add_item(self, item: dict) -> tuple[int, bytes]:
        self.items.append(item)
        index = len(self.items) - 1
        return index, self.event("response.output_item.added", output_index=index, item=dict(item, content=[])
                                 if item["type"] != "function_call" else item)


async def _events(body: ResponsesRequest, snapshot: _Snapshot, generation: Generation, reasoning_parser: str | None):
    writer = _EventWriter(snapshot)
    reasoning_stream = ReasoningStream() if reasoning_parser is not None else None
    tool_stream = ToolCallStream() if body.parses_tool_calls else None
    open_item: tuple[int, dict] | None = None  # the reasoning or message item text is flowing into
    texts: dict[int, str] = {}
    num_calls = 0

    def close_open_item(status: str):
        nonlocal open_item
        if open_item is None:
            return
        index, item = open_item
        text, open_item = texts[index], None
        item["status"] = status
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            yield writer.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            yield writer.event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text, logprobs=[])
            yield writer.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        yield writer.event("response.output_item.done", output_index=index, item=item)

    def text_into(kind: str, delta: str):
        """Open the ``kind`` item if another (or none) is open, then send ``delta`` into it."""
        nonlocal open_item
        if open_item is None or open_item[1]["type"] != kind:
            yield from close_open_item("completed")
            item = (_reasoning_item(_item_id("rs"), "", "in_progress") if kind == "reasoning"
                    else _message_item(_item_id("msg"), None, "in_progress"))
            index, added = writer.add_item(item)
            yield added
            texts[index] = ""
            if kind == "message":
                yield writer.event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []})
            open_item = (index, item)
        index, item = open_item
        texts[index] += delta
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        yield writer.event(kind_event, item_id=item["id"], output_index=index, content_index=0, delta=delta, **extra)

    try:
        yield writer.event("response.created", response=snapshot.response([]))
        yield writer.event("response.in_progress", response=snapshot.response([]))
        sent_text, output, completion = "", None, None
        async for output in generation:
            completion = output.outputs[0]
            finished = completion.finish_reason is not None
            delta, sent_text = completion.text[len(sent_text):], completion.text
            reasoning, content = reasoning_stream.feed(delta, finished) if reasoning_stream else ("", delta)
            calls = []
            if tool_stream is not None:
                content, calls = tool_stream.feed(content, finished)
            if reasoning:
                for event in text_into("reasoning", reasoning):
                    yield event
            if content:
                for event in text_into("message", content):
                    yield event
            for call in calls:
                if body.max_tool_calls is not None and num_calls >= body.max_tool_calls:
                    continue
                num_calls += 1
                for event in close_open_item("completed"):
                    yield event
                item = _call_item(call)
                index, added = writer.add_item(dict(item, arguments="", status="in_progress"))
                writer.items[index] = item
                yield added
                yield writer.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=item["arguments"])
                yield writer.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"])
                yield writer.event("response.output_item.done", output_index=index, item=item)
        if completion is None:
            return
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        if not writer.items:  # an empty reply still has its (empty) message
            for event in text_into("message", ""):
                yield event
        for event in close_open_item(status):
            yield event
        final = snapshot.response(writer.items, completion, output)
        yield writer.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                           response=final)
    except Exception as error:  # headers are sent: the error travels as an event
        api_error = engine_error(error)
        yield writer.event("error", code=api_error.code, message=api_error.message, param=api_error.param)
    finally:
        generation.close()
