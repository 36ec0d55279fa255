"""Reasoning in chat completions: the ``<think>...</think>`` part of a reply goes to the message's
``reasoning_content``, the rest to ``content`` (``weir serve --reasoning-parser qwen3``, as vLLM
names it; Qwen3 and the DeepSeek-R1 distills write it this way).

A reply that does not start with ``<think>`` has no reasoning (Qwen3 with ``enable_thinking``
off). One that opens ``<think>`` and never closes it (cut by ``max_tokens``) is all reasoning.
Streams hold back text that may be the start of either tag, so no delta ever shows part of one.
"""

from __future__ import annotations

from dataclasses import dataclass

from weir.server.tool_calls import partial_tag_length

START, END = "<think>", "</think>"
PARSERS = ("qwen3",)


def parse_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished reply; either is None when empty."""
    reasoning, content = ReasoningStream().feed(text, finished=True)
    return reasoning or None, content or None


@dataclass
class ReasoningStream:
    """Splits one choice's streamed text into reasoning and content deltas."""

    pending: str = ""
    state: str = "start"  # "start": undecided, then "reasoning" or "content"

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning to send now, content to send now)."""
        self.pending += delta
        reasoning = ""
        if self.state == "start":
            stripped = self.pending.lstrip()
            if stripped.startswith(START):
                self.state, self.pending = "reasoning", stripped[len(START):]
            elif START.startswith(stripped) and not finished:
                return "", ""  # whitespace or the start of "<think>" so far: undecided
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.pending.find(END)
            if end != -1:
                reasoning, self.pending = self.pending[:end], self.pending[end + len(END):]
                self.state = "content"
            else:
                keep = 0 if finished else partial_tag_length(self.pending, END)
                reasoning = self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return reasoning, ""
        content, self.pending = self.pending, ""
        return reasoning, content
