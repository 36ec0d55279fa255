"""Reading and validating request bodies: size limit (413), JSON (400), schema (400).

What ``json.loads`` takes but this server cannot answer with is refused here, before any field
is used, so no echo of a field can fail later: NaN and Infinity (and numbers too large for a
double) are not JSON numbers, an integer literal longer than Python converts is not one it can
hold, and a lone UTF-16 surrogate (``"\\ud800"``, or the raw bytes ``ED A0 80`` that the parser
reads as one) is not text: no UTF-8 response can carry it back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import sys
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from weir.server.errors import APIError, bad_request, from_validation_error
from weir.server.settings import ServerSettings

logger = logging.getLogger(__name__)
Model = TypeVar("Model", bound=BaseModel)

# Where a lone surrogate can come from: a \uD800-\uDFFF escape, or the raw UTF-8 form of one
# (which json.loads decodes with "surrogatepass"). Searched in the raw bytes (fast); only a body
# with a hit is walked, to tell a lone surrogate from an escaped pair (an emoji) and to name it.
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_MAX_PARAM_CHARS = 200


class _NotANumber(ValueError):
    """A JSON number this server refuses; its message says which."""


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes "
                         f"(--max-request-body-bytes)", code="request_too_large")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise _NotANumber(f"the number {literal[:40]} is too large (beyond a double's range)")
    return value


def _refuse_constant(name: str) -> None:
    raise _NotANumber(f"{name} is not a JSON number")


def _decode(raw: bytes):
    try:
        # UTF-8 only (json.loads of bytes would also take UTF-16 and UTF-32, which the surrogate
        # check below cannot search); "surrogatepass" lets ED A0 80 through, to be named there.
        text = raw.decode("utf-8", "surrogatepass")
        return json.loads(text, parse_float=_finite_float, parse_constant=_refuse_constant)
    except _NotANumber as error:
        raise bad_request(f"the request body is not valid JSON: {error}", code="invalid_json") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}", code="invalid_json") from error
    except RecursionError as error:
        raise bad_request("the request body nests JSON arrays or objects too deeply to parse",
                          code="invalid_json") from error
    except ValueError as error:  # int() refuses literals longer than sys.get_int_max_str_digits()
        raise bad_request(f"the request body holds an integer literal of more than "
                          f"{sys.get_int_max_str_digits()} digits", code="invalid_json") from error


def _lone_surrogate(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"U+{ord(text[error.start]):04X}"
    return None


def _find_lone_surrogate(data) -> tuple[str | None, str, bool] | None:
    """The first lone surrogate in a string or key of ``data``: (the field it is in, as
    ``messages.0.content``, or the object whose key it is in; the surrogate; whether in a key).
    Walked without recursion, to any depth the parser took."""
    stack: list[tuple[str | None, object]] = [(None, data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _lone_surrogate(value)
            if found:
                return path, found, False
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                found = _lone_surrogate(key)
                if found:
                    return path, found, True
                items.append((key if path is None else f"{path}.{key}", item))
            stack.extend(reversed(items))  # popped in the body's order
        elif isinstance(value, list):
            stack.extend((str(index) if path is None else f"{path}.{index}", value[index])
                         for index in range(len(value) - 1, -1, -1))
    return None


async def read_json(request: Request, settings: ServerSettings) -> dict:
    """The body as a JSON object; refuses a body over ``--max-request-body-bytes`` before reading
    all of it, and one that does not arrive within ``--timeout-header`` of its headers (408: a
    client trickling its body would otherwise hold its connection, and a slot of
    ``--max-connections``, forever)."""
    limit = settings.max_request_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(settings.timeout_header):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {settings.timeout_header:g} s of its "
                            f"headers (--timeout-header)", code="request_timeout") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    data = _decode(raw)
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {type(data).__name__}")
    found = _find_lone_surrogate(data) if _SURROGATE_HINT.search(raw) else None
    if found:
        path, surrogate, in_key = found
        param = None if path is None else path[:_MAX_PARAM_CHARS]
        where = f"'{param}'" if path is not None else "the request body"
        where = f"a key of {where}" if in_key else where
        raise bad_request(f"{where} is not valid Unicode text: it holds a lone UTF-16 surrogate ({surrogate}), "
                          f"which UTF-8 cannot encode", param=param, code="invalid_text")
    return data


def parse(model: type[Model], data: dict) -> Model:
    try:
        parsed = model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from error
    # As vLLM, unknown fields do not fail the request; the ones the request checks itself (and
    # refuses when asked for) are not unknown.
    unknown = sorted(set(parsed.model_extra or {}) - getattr(model, "CHECKED_EXTRA_FIELDS", frozenset()))
    if unknown:
        logger.warning("ignoring unknown request field(s): %s", ", ".join(unknown))
    return parsed
