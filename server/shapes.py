"""Pieces of OpenAI's response bodies shared by chat and completions."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from weir.outputs import CompletionOutput
from weir.server.errors import APIError
from weir.streams import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)


@dataclass
class ResponseHeader:
    """``id``, ``object``, ``created``, ``model``, ``system_fingerprint``: the same on every chunk."""

    request_id: str
    object: str
    model: str
    system_fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices, **extra}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache served as ``cached_tokens``."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def finish_reason(completion: CompletionOutput) -> str | None:
    """OpenAI's ``stop`` / ``length``; an engine-side abort is an error, not a reason."""
    if completion.finish_reason == "abort":
        raise APIError(503, "the request was aborted by the server (it is shutting down)",
                       code="request_aborted")
    return completion.finish_reason


def engine_error(error: Exception) -> APIError:
    """What a failure while generating means to the client."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), code="engine_unavailable")
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), code="engine_error")
    logger.exception("request failed", exc_info=error)
    return APIError(500, f"internal error: {error!r}", code="internal_error")
