"""Log probabilities in OpenAI's two shapes.

The engine gives, per generated token, a dict token id -> ``Logprob`` holding the sampled token
and the top k (the sampled one may be among them, so there are k or k + 1 entries).
"""

from __future__ import annotations

import math
import re

from weir.outputs import Logprob

# JSON has no -inf; OpenAI clients expect a number.
_FLOOR = -9999.0


_SENTENCEPIECE_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (GPT-2's table), reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


class TokenBytes:
    """A token's raw bytes (OpenAI's ``bytes``), which its decoded text cannot give for a token
    holding part of a multi-byte character. Cached per token id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = type(getattr(backend, "decoder", None)).__name__
        self._byte_level = _byte_level_table() if decoder == "ByteLevel" else None
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id, text)
        return cached

    def _bytes(self, token_id: int, text: str) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level is not None and all(char in self._byte_level for char in piece):
                return [self._byte_level[char] for char in piece]
            byte = _SENTENCEPIECE_BYTE.match(piece)
            if byte:
                return [int(byte.group(1), 16)]
            if self._byte_level is None and "\ufffd" not in text:
                return list(piece.replace("\u2581", " ").encode())
        return list(text.encode())


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def _text(entry: Logprob) -> str:
    return entry.decoded_token or ""


def _top(entries: dict[int, Logprob], count: int) -> list[tuple[int, Logprob]]:
    return sorted(entries.items(), key=lambda item: -item[1].logprob)[:count]


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                  token_bytes: TokenBytes) -> list[dict]:
    """``choices[].logprobs.content`` entries: token, logprob, bytes, top_logprobs."""
    def entry_of(token_id: int, entry: Logprob) -> dict:
        return {"token": _text(entry), "logprob": _value(entry.logprob),
                "bytes": token_bytes(token_id, _text(entry))}

    content = []
    for token_id, entries in zip(token_ids, logprobs):
        item = entry_of(token_id, entries[token_id])
        item["top_logprobs"] = [entry_of(top_id, entry) for top_id, entry in _top(entries, num_top)]
        content.append(item)
    return content


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        text_offset: int) -> tuple[dict, int]:
    """The legacy ``{tokens, token_logprobs, top_logprobs, text_offset}``, and the text offset
    after the last token (where a stream's next chunk starts)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entries in zip(token_ids, logprobs):
        sampled = entries[token_id]
        tokens.append(_text(sampled))
        token_logprobs.append(_value(sampled.logprob))
        # OpenAI returns the top k plus the sampled token when it is not among them.
        top_logprobs.append({_text(entry): _value(entry.logprob) for _, entry in _top(entries, len(entries))})
        offsets.append(text_offset)
        text_offset += len(_text(sampled))
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)
