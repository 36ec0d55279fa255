"""Tool calls in chat completions, in the Hermes format Qwen and NousResearch models write:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the generated text.

The chat template renders the request's ``tools``; what the model writes back is parsed here into
OpenAI ``tool_calls`` (``weir serve --tool-call-parser hermes``, as vLLM names it). A block that
is not valid JSON with a ``name`` is left in the text as content, so nothing the model wrote is
lost. Streams hold back text that may be the start of a ``<tool_call>`` tag and send each call
whole, with its full arguments, once its block closes (OpenAI clients accumulate call deltas by
index, so one delta per call is a valid stream).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


def _call(block: str) -> dict | None:
    """The OpenAI tool call a block's JSON names, or None when it is not a call."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished completion's text. Content is the text outside the
    call blocks, stripped, or None when there is none and there are calls."""
    calls, kept, position = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1).strip())
        if call is None:
            continue  # stays in the content
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[position:])
    content = "".join(kept).strip()
    return content or None, calls


def _partial_tag_length(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<tool_call>``."""
    for length in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-length:]):
            return length
    return 0


@dataclass
class ToolCallStream:
    """Splits one choice's streamed text into content deltas and whole tool calls."""

    pending: str = ""  # text not yet sent: a possible tag start, or an open call block
    num_calls: int = 0
    _inside: bool = field(default=False, repr=False)

    def feed(self, delta: str, finished: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, calls completed by this delta, each with its ``index``)."""
        self.pending += delta
        content, calls = [], []
        while True:
            if self._inside:
                end = self.pending.find(END)
                if end == -1:
                    break
                block = self.pending[:end]
                self.pending = self.pending[end + len(END):]
                self._inside = False
                call = _call(block.strip())
                if call is None:
                    content.append(START + block + END)
                else:
                    calls.append({"index": self.num_calls, **call})
                    self.num_calls += 1
                continue
            start = self.pending.find(START)
            if start == -1:
                keep = 0 if finished else _partial_tag_length(self.pending)
                content.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            content.append(self.pending[:start])
            self.pending = self.pending[start + len(START):]
            self._inside = True
        if finished and self._inside:  # a block never closed: the model's text, as written
            content.append(START + self.pending)
            self.pending, self._inside = "", False
        return "".join(content), calls
