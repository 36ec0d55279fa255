"""Incremental detokenization of one completion, with stop strings.

Tokens arrive one at a time; ``tokenizers.decoders.DecodeStream`` turns them into text and holds
back bytes until a multi-byte character is whole. After each token the stop strings are searched
only where a new match can be; a match truncates the text at the stop string's start.
``next_delta`` hands out the text a stream may show: it withholds the tail that could still turn
out to be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from weir.sampling_params import SamplingParams

# Prompt tokens given to the stream as context, so the first output token decodes as it would
# mid-text (leading spaces, merges across the boundary); a few are enough.
_MAX_PROMPT_CONTEXT_TOKENS = 8


def backend_tokenizer(tokenizer: object) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer (or the object itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for attribute in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, attribute, None)
        if isinstance(backend, Tokenizer):
            return backend
    raise TypeError(
        f"tokenizer {type(tokenizer).__name__} has no `tokenizers.Tokenizer` backend "
        "(backend_tokenizer); Weir needs a fast tokenizer to detokenize incrementally"
    )


def decode_token(tokenizer: object, token_id: int) -> str:
    """One token as text, for ``Logprob.decoded_token``; a partial UTF-8 byte reads as U+FFFD."""
    return backend_tokenizer(tokenizer).decode([token_id], skip_special_tokens=False)


def _prompt_context(backend: Tokenizer, prompt_token_ids: Sequence[int]) -> list[int]:
    """The shortest prompt suffix (at least 4 tokens when the prompt has them) that starts and
    ends on a whole character; none when there is no such suffix.

    A context that began inside a split UTF-8 sequence would decode wrongly; one that ended
    inside one would be completed by the first output token, and the stream would then hand out
    the whole context as output text. Without context, output bytes that continue a character
    the prompt began read as U+FFFD, as ``tokenizer.decode(output_ids)`` has them.
    """
    num_tokens = len(prompt_token_ids)
    for length in range(min(4, num_tokens), min(_MAX_PROMPT_CONTEXT_TOKENS, num_tokens) + 1):
        suffix = list(prompt_token_ids[num_tokens - length :])
        text = backend.decode(suffix, skip_special_tokens=False)
        if not text.startswith("\ufffd") and not text.endswith("\ufffd"):
            return suffix
    return []


class IncrementalDetokenizer:
    """Text of one completion, grown token by token, cut at the first stop string (before it, or
    after it with ``include_stop_str_in_output``)."""

    def __init__(self, tokenizer: object, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._backend = backend_tokenizer(tokenizer)
        self._context = _prompt_context(self._backend, prompt_token_ids)
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=params.skip_special_tokens)
        self._num_held = 0  # tokens the stream holds back: the start of a character not yet whole
        self._stop_strings: list[str] = list(params.stop)
        self._keep_stop = params.include_stop_str_in_output
        # As vLLM: stop strings are not looked for until min_tokens tokens are out.
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        # Text that may yet turn out to start a stop string is held back, unless stop strings stay in.
        self._longest_stop = 0 if self._keep_stop else max((len(stop) for stop in self._stop_strings), default=0)
        self._text = ""
        self._num_returned_chars = 0  # how much of the text next_delta has handed out
        self.stop_string_hit: str | None = None

    @property
    def output_text(self) -> str:
        return self._text

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it added to ``output_text`` (may be "").

        Once a stop string has been hit the text is final and further tokens are ignored (the
        engine may have sampled one more token before it saw the stop).
        """
        if self.stop_string_hit is not None:
            return ""
        self._num_tokens += 1
        new_text = self._stream.step(self._backend, token_id)
        if not new_text:
            self._num_held += 1
            return ""  # None: the token only started a multi-byte character
        self._num_held = 0
        return self._add_text(new_text)

    def finish(self, token_ids: Sequence[int]) -> str:
        """The completion ended with ``token_ids`` (every token appended): add what the stream
        still holds (bytes of a character the last tokens began but never finished read as
        U+FFFD, as ``tokenizer.decode`` has them)."""
        num_held, self._num_held = self._num_held, 0
        if self.stop_string_hit is not None or not num_held:
            return ""
        context_text = self._decode(self._context)
        full = self._decode(self._context + list(token_ids))
        if full.startswith(context_text + self._text):
            held_text = full[len(context_text) + len(self._text):]
        else:  # a decoder whose output is not the sum of its parts: decode the held tokens alone
            held_text = self._decode(list(token_ids[-num_held:]))
        return self._add_text(held_text) if held_text else ""

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _add_text(self, new_text: str) -> str:
        previous_length = len(self._text)
        self._text += new_text
        self._check_stop_strings(num_new_chars=len(new_text))
        return self._text[previous_length:]

    def _check_stop_strings(self, num_new_chars: int) -> None:
        if not self._stop_strings or self._num_tokens < self._min_tokens:
            return
        earliest_start, earliest_stop = len(self._text), None
        for stop in self._stop_strings:
            # A new match must end inside the new text, so it starts at most len(stop) - 1
            # before it; searching from further back would let a stop string that completed
            # before min_tokens count later.
            search_from = max(0, len(self._text) - num_new_chars - (len(stop) - 1))
            start = self._text.find(stop, search_from)
            if start != -1 and start < earliest_start:
                earliest_start, earliest_stop = start, stop
        if earliest_stop is not None:
            self._text = self._text[:earliest_start + (len(earliest_stop) if self._keep_stop else 0)]
            self.stop_string_hit = earliest_stop

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: all of it once finished, otherwise without the last
        ``longest stop - 1`` characters, which could still turn out to start a stop string."""
        if finished or self.stop_string_hit is not None:
            return self._text
        return self._text[: max(0, len(self._text) - max(0, self._longest_stop - 1))]

    def next_delta(self, finished: bool) -> str:
        """Text not yet handed out. While the completion runs, the last ``longest stop - 1``
        characters are withheld, so a stream never shows the start of a stop string."""
        end = len(self._text)
        if not finished and self.stop_string_hit is None:
            end -= max(0, self._longest_stop - 1)
        if end <= self._num_returned_chars:
            return ""
        delta = self._text[self._num_returned_chars : end]
        self._num_returned_chars = end
        return delta
