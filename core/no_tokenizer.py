"""Stand-ins for the tokenizer and the detokenizer under ``skip_tokenizer_init``.

With ``skip_tokenizer_init`` the engine loads no tokenizer at all: prompts come as token ids and
completions go out as token ids, with empty text (as vLLM). These stand-ins take the places the
tokenizer and the incremental detokenizer have, so every path that would need text fails with
one clear ``ValueError`` naming the option instead of an ``AttributeError`` on ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn


def tokenizer_required_message(what: str) -> str:
    """Why ``what`` (subject and verb: "a text prompt needs") cannot be served without a tokenizer."""
    return (f"{what} a tokenizer, and this engine was started with skip_tokenizer_init (no tokenizer "
            f"loaded): send prompts as token ids (prompt_token_ids) and read token_ids from the outputs, or "
            f"start it without skip_tokenizer_init")


class NoTokenizer:
    """The engine's ``tokenizer`` under ``skip_tokenizer_init``: any use of it is a ValueError."""

    chat_template = None

    def _refuse(self, what: str) -> NoReturn:
        raise ValueError(tokenizer_required_message(what))

    def encode(self, text: str, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a text prompt needs")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a text prompt needs")

    def decode(self, token_ids: Sequence[int], *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("turning token ids into text needs")

    def convert_ids_to_tokens(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("turning token ids into text needs")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("a chat request (its chat template) needs")


class TokenIdsOnly:
    """The detokenizer of one completion when there is no tokenizer: the text stays empty, and
    stop strings never match (the engine refuses requests that set them)."""

    stop_string_hit = None
    output_text = ""

    def append(self, token_id: int) -> str:
        return ""

    def finish(self, token_ids: Sequence[int]) -> str:
        return ""

    def visible_text(self, finished: bool) -> str:
        return ""

    def next_delta(self, finished: bool) -> str:
        return ""


def has_tokenizer(tokenizer: object) -> bool:
    return not isinstance(tokenizer, NoTokenizer)
