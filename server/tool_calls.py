"""Tool calls in chat completions, in the Hermes format Qwen and NousResearch models write:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the generated text.

The chat template renders the request's ``tools``; what the model writes back is parsed here into
OpenAI ``tool_calls`` (``weir serve --tool-call-parser hermes``, as vLLM names it). A block ends at
the first ``</tool_call>`` after which its JSON parses (an argument may contain the tag), or at the
end of the reply when the model stopped before closing it. A block that is not valid JSON with a
``name`` stays in the text as content, so nothing the model wrote is lost.

Content is the text outside the blocks, with whitespace-only stretches after a call dropped (the
newlines models put between calls), and None when nothing is left. Streams send the same: they
hold back text that may be the start of a tag, and whitespace after a call until more text
follows; each call goes out whole, with its full arguments, once its block closes (OpenAI clients
accumulate call deltas by index, so one delta per call is a valid stream).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def _call(block: str) -> dict | None:
    """The OpenAI tool call a block's JSON names, or None when it is not a call."""
    try:
        value = json.loads(block)
    except (ValueError, RecursionError):  # not JSON, an integer past int()'s digit limit, nested too deep
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not (_utf8_text(value["name"]) and _utf8_text(arguments)):
        return None  # a \ud800 escape decodes to a lone surrogate no response can carry: it stays text
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments}}


def _utf8_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _close_block(body: str, finished: bool) -> tuple[dict | None, int] | None:
    """The call a block body (the text after ``<tool_call>``) holds and how much of ``body`` it
    takes, end tag included; None while more text could still complete it. ``(None, n)``: the
    first ``n`` characters are a block that is not a call."""
    end = body.find(END)
    while end != -1:
        call = _call(body[:end].strip())
        if call is not None:
            return call, end + len(END)
        end = body.find(END, end + 1)
    if finished:  # never closed: a call if what is there parses, else the model's text
        return _call(body.strip()), len(body)
    return None


def _whitespace_run(text: str, after_call: bool) -> bool:
    return after_call and not text.strip()


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished reply's text."""
    stream = ToolCallStream()
    content, calls = stream.feed(text, finished=True)
    return (content if content.strip() else None) if calls else text, calls


@dataclass
class ToolCallStream:
    """Splits one choice's text, streamed or whole, into content and whole tool calls."""

    pending: str = ""  # text not yet sent: a possible tag start, an open block, whitespace after a call
    num_calls: int = 0
    inside: bool = False

    def feed(self, delta: str, finished: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, calls completed by this delta, each with its ``index``)."""
        self.pending += delta
        content, calls = [], []
        while True:
            if self.inside:
                closed = _close_block(self.pending, finished)
                if closed is None:
                    break
                call, taken = closed
                block, self.pending = self.pending[:taken], self.pending[taken:]
                self.inside = False
                if call is None:
                    content.append(START + block)
                else:
                    calls.append({"index": self.num_calls, **call})
                    self.num_calls += 1
                continue
            start = self.pending.find(START)
            text = self.pending if start == -1 else self.pending[:start]
            if start == -1 and not finished:  # keep what may begin a tag
                keep = partial_tag_length(self.pending, START)
                text = self.pending[:len(self.pending) - keep]
            if _whitespace_run(text, self.num_calls > 0) and not finished and start == -1:
                break  # whitespace after a call: sent only if more text follows
            if not _whitespace_run(text, self.num_calls > 0):
                content.append(text)
            self.pending = self.pending[len(text):]
            if start == -1:
                break
            self.pending = self.pending[len(START):]
            self.inside = True
        return "".join(content), calls


def partial_tag_length(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag`` (a stream holds them back)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
