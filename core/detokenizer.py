"""Incremental detokenization of one completion, with stop strings.

Tokens arrive one at a time; ``_TextStream`` turns them into text as ``tokenizers``'
``DecodeStream`` does (each token decoded after the ones before it) and holds back bytes while a
multi-byte character may still be finished, but never longer (``DecodeStream`` alone holds a run
of lone UTF-8 lead bytes without bound). After each token the stop strings are searched only
where a new match can be; a match truncates the text at the stop string's start.
``next_delta`` hands out the text a stream may show: it withholds the tail that could still turn
out to be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

from weir.sampling_params import SamplingParams

# Prompt tokens given to the stream as context, so the first output token decodes as it would
# mid-text (leading spaces, merges across the boundary); a few are enough.
_MAX_PROMPT_CONTEXT_TOKENS = 8
_REPLACEMENT = "\ufffd"
# No character is longer than 4 bytes, so bytes still waiting for the rest of one are at most 3.
_MAX_UNFINISHED_BYTES = 3
# A decoder that decodes a byte run only as a whole (ByteFallback) re-decodes the held run at
# every token: past this many held tokens the run is cut and handed out as it reads then.
_MAX_HELD_TOKENS = 32


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


def _prompt_context(backend: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
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
        # As the stream will decode it: a special token it skips must not hide a split character.
        text = backend.decode(suffix, skip_special_tokens=skip_special_tokens)
        if not text.startswith("\ufffd") and not text.endswith("\ufffd"):
            return suffix
    return []


class _TextStream:
    """The text of a growing token sequence, piece by piece.

    Pieces come from ``tokenizers.decoders.DecodeStream``: it keeps the tokens of the last piece
    as context (the read part), so a token's text is the decoding of context and new tokens less
    the context's own text (leading spaces and merges come out as in the whole text), and it holds
    the new tokens while that text ends in U+FFFD. It holds them without bound, though: a run of
    lone UTF-8 lead bytes is never a whole character, so it shows nothing until ordinary text
    follows. No character is longer than 4 bytes, so once it holds 4 tokens, some of what they
    hold can no longer become part of a character: this class then holds them instead, the same
    way, except that only the last characters that may still become part of one are held; those
    before them are handed out at once, as ``tokenizer.decode`` of all tokens shows them. When
    the text is whole again, a new ``DecodeStream`` takes over (the fast path: it runs per token
    per request, and valid text never leaves it).

    How many U+FFFD an unfinished character shows as depends on the decoder. The byte-level one
    turns all bytes into text at once, one U+FFFD per maximal invalid sequence (Rust's
    ``from_utf8_lossy``): an unfinished character is the last U+FFFD, and what comes before it
    is final whatever follows, so tokens whose text is out can join the read part and the held
    tokens stay few. Others may write one per byte (``ByteFallback`` does for a run of byte
    tokens that is not valid UTF-8, and decodes a run as a whole): up to 3 are held, and the read
    part moves only at the end of a piece, as in ``DecodeStream``.
    """

    def __init__(self, backend: Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool):
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._bytes_as_a_whole = isinstance(backend.decoder, decoders.ByteLevel)
        self._max_unfinished = 1 if self._bytes_as_a_whole else _MAX_UNFINISHED_BYTES
        self._read_ids = list(context_ids)  # the last piece's tokens: the next one's context
        self._new_ids: list[int] = []  # tokens since, held while their text ends unfinished
        self._fast: DecodeStream | None = DecodeStream(ids=list(context_ids),
                                                       skip_special_tokens=skip_special_tokens)
        # While tokens are held (no DecodeStream):
        self._read_text = ""  # the read part's own text
        self._new_text = ""  # the held tokens' text, as last decoded
        self._num_released = 0  # characters of it handed out already

    @property
    def holds_tokens(self) -> bool:
        return bool(self._new_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one token; return the text that can no longer change (may be "")."""
        self._new_ids.append(token_id)
        if self._fast is not None:
            try:
                piece = self._fast.step(self._backend, token_id)
            except Exception:  # its InvalidPrefix: the text handed out changed (see _held_step)
                broken = True
            else:
                if piece is not None:
                    self._read_ids, self._new_ids = self._new_ids, []
                    return piece
                broken = False
            if len(self._new_ids) <= _MAX_UNFINISHED_BYTES and not broken:
                return ""  # may be a character whose bytes are still coming
            # More tokens than a character has bytes: some of what they hold is final.
            self._fast = None
            self._read_text, self._num_released = self._decode(self._read_ids), 0
        return self._held_step()

    def _held_step(self) -> str:
        text = self._decode(self._read_ids + self._new_ids)
        if not text.startswith(self._read_text):
            # ByteFallback decodes a run of byte tokens as a whole: a byte that can never be
            # valid turns the run's earlier, complete characters into U+FFFD too. What was handed
            # out stays; go on with the held tokens alone.
            self._read_ids, self._read_text = [], ""
            text = self._decode(self._new_ids)
        new_text = self._new_text = text[len(self._read_text):]
        if new_text.endswith(_REPLACEMENT) and (self._bytes_as_a_whole or len(self._new_ids) < _MAX_HELD_TOKENS):
            return self._release(len(new_text) - self._max_unfinished)
        if not new_text and not self._bytes_as_a_whole:
            return ""  # skipped special tokens, say: kept, as DecodeStream keeps them
        piece = new_text[self._num_released:]
        if new_text:
            self._read_ids = self._new_ids
        # else only skipped special tokens (every other byte-level token has bytes): they change
        # no decoding, so they go and the read part stays
        self._new_ids = []
        self._resume_fast_path()
        return piece

    def _resume_fast_path(self) -> None:
        self._fast = DecodeStream(ids=list(self._read_ids), skip_special_tokens=self._skip_special_tokens)
        self._read_text, self._new_text, self._num_released = "", "", 0

    def flush(self) -> str:
        """The text still held (an unfinished character reads as U+FFFD): the sequence ended."""
        if not self._new_ids:
            return ""
        if self._fast is not None:  # DecodeStream holds them: none of their text is out yet
            read_text, num_released = self._decode(self._read_ids), 0
        else:
            read_text, num_released = self._read_text, self._num_released
        text = self._decode(self._read_ids + self._new_ids)
        piece = text[len(read_text) + num_released:] if text.startswith(read_text) else ""
        self._read_ids, self._new_ids = self._new_ids, []
        self._resume_fast_path()
        return piece

    def _release(self, num_final_chars: int) -> str:
        if num_final_chars <= self._num_released:
            return ""
        piece = self._new_text[self._num_released:num_final_chars]
        self._num_released = num_final_chars
        if self._bytes_as_a_whole:
            self._advance_read_part()
        return piece

    def _advance_read_part(self) -> None:
        """Keep the held tokens few while the text stays unfinished: the longest run of them
        whose text is all handed out becomes the read part. Only the last few tokens can hold
        the unfinished character's bytes, so only the cuts just before them are tried."""
        released = self._read_text + self._new_text[:self._num_released]
        num_new = len(self._new_ids)
        for cut in range(num_new - 1, max(0, num_new - 2 - self._max_unfinished), -1):
            head_text = self._decode(self._read_ids + self._new_ids[:cut])
            if head_text.startswith(self._read_text) and released.startswith(head_text):
                consumed = len(head_text) - len(self._read_text)
                self._read_ids, self._new_ids = self._new_ids[:cut], self._new_ids[cut:]
                self._read_text = self._decode(self._read_ids)
                self._new_text = self._new_text[consumed:]
                self._num_released -= consumed
                return


class IncrementalDetokenizer:
    """Text of one completion, grown token by token, cut at the first stop string (before it, or
    after it with ``include_stop_str_in_output``)."""

    def __init__(self, tokenizer: object, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._backend = backend_tokenizer(tokenizer)
        self._context = _prompt_context(self._backend, prompt_token_ids, params.skip_special_tokens)
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = _TextStream(self._backend, self._context, params.skip_special_tokens)
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
        new_text = self._stream.step(token_id)
        return self._add_text(new_text) if new_text else ""

    def finish(self, token_ids: Sequence[int]) -> str:
        """The completion ended with ``token_ids`` (every token appended): add what the stream
        still holds (bytes of a character the last tokens began but never finished read as
        U+FFFD, as ``tokenizer.decode`` has them)."""
        if self.stop_string_hit is not None or not self._stream.holds_tokens:
            return ""
        context_text = self._decode(self._context)
        full = self._decode(self._context + list(token_ids))
        held_text = self._stream.flush()
        if full.startswith(context_text + self._text):
            held_text = full[len(context_text) + len(self._text):]
        # else a decoder whose output is not the sum of its parts: the stream's own reading stands
        return self._add_text(held_text) if held_text else ""

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _add_text(self, new_text: str) -> str:
        previous_length = len(self._text)
        self._text += new_text
        if not self._stop_strings:  # nothing can cut it (and this runs per token)
            return new_text
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
