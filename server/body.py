"""Reading and validating request bodies: size limit (413), JSON (400), schema (400)."""

from __future__ import annotations

import json
import logging
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from weir.server.errors import APIError, bad_request, from_validation_error

logger = logging.getLogger(__name__)
Model = TypeVar("Model", bound=BaseModel)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes "
                         f"(--max-request-body-bytes)", code="request_too_large")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; refuses a body over ``limit`` bytes before reading all of it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}", code="invalid_json") from error
    except RecursionError as error:
        raise bad_request("the request body nests JSON arrays or objects too deeply to parse",
                          code="invalid_json") from error
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {type(data).__name__}")
    return data


def parse(model: type[Model], data: dict) -> Model:
    try:
        parsed = model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from error
    if parsed.model_extra:  # as vLLM does: unknown fields do not fail the request
        logger.warning("ignoring unknown request field(s): %s", ", ".join(sorted(parsed.model_extra)))
    return parsed
