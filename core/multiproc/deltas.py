"""Outputs across the process boundary as deltas.

The engine's ``RequestOutput`` is cumulative (every token and all the text so far), so sending
it whole each step would pickle O(n) per token. The engine process sends what is new since the
last output of that request; the server's process appends it to what it has and hands its
streams cumulative outputs again, each built fresh (a reader may still hold the previous one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weir.outputs import CompletionOutput, RequestOutput


@dataclass
class CompletionDelta:
    index: int
    # The completion's text is its first ``text_offset`` characters as sent so far, then ``text``;
    # likewise its token ids and logprobs (an offset below what was sent replaces the rest).
    text_offset: int
    text: str
    token_offset: int
    token_ids: list[int]
    logprobs: list[dict] | None  # None: the request asked for none
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    spec_decode_metrics: Any


@dataclass
class OutputDelta:
    key: int  # the receiving process's name for the request's stream
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int | None
    prompt: str | None = None  # these two only in a request's first delta
    prompt_token_ids: list[int] | None = None


class DeltaEncoder:
    """Engine side: remembers, per stream key, what was sent of each completion."""

    def __init__(self):
        self._sent: dict[int, dict[int, tuple[str, int]]] = {}  # key -> index -> (text, number of token ids)

    def encode(self, key: int, output: RequestOutput) -> OutputDelta:
        first = key not in self._sent
        sent = self._sent.setdefault(key, {})
        completions = []
        for completion in output.outputs:
            text, num_tokens = sent.get(completion.index, ("", 0))
            text_offset = len(text) if completion.text.startswith(text) else 0
            token_offset = min(num_tokens, len(completion.token_ids))
            completions.append(CompletionDelta(
                completion.index, text_offset, completion.text[text_offset:], token_offset,
                completion.token_ids[token_offset:],
                None if completion.logprobs is None else completion.logprobs[token_offset:],
                completion.cumulative_logprob, completion.finish_reason, completion.stop_reason,
                completion.spec_decode_metrics))
            sent[completion.index] = (completion.text, len(completion.token_ids))
        if output.finished:
            del self._sent[key]
        return OutputDelta(key, completions, output.finished, output.num_cached_tokens,
                           output.prompt if first else None, output.prompt_token_ids if first else None)

    def forget(self, key: int) -> None:
        self._sent.pop(key, None)


class DeltaDecoder:
    """Server side: one per stream, turning its deltas back into cumulative outputs."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._prompt: str | None = None
        self._prompt_token_ids: list[int] = []
        self._completions: dict[int, CompletionOutput] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        if delta.prompt_token_ids is not None:
            self._prompt, self._prompt_token_ids = delta.prompt, delta.prompt_token_ids
        for part in delta.completions:
            previous = self._completions.get(part.index)
            if previous is None:
                text, token_ids, logprobs = "", [], None
            else:
                text, token_ids, logprobs = previous.text, previous.token_ids, previous.logprobs
            logprobs = None if part.logprobs is None else (logprobs or [])[: part.token_offset] + part.logprobs
            self._completions[part.index] = CompletionOutput(
                part.index, text[: part.text_offset] + part.text, token_ids[: part.token_offset] + part.token_ids,
                part.cumulative_logprob, logprobs, part.finish_reason, part.stop_reason, part.spec_decode_metrics)
        return RequestOutput(self.request_id, self._prompt, self._prompt_token_ids,
                             [self._completions[index] for index in sorted(self._completions)], delta.finished,
                             delta.num_cached_tokens)
