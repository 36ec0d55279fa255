"""OpenAI-shaped errors: every failure is ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import re

from pydantic import ValidationError
from starlette.responses import JSONResponse

# Union members appear in pydantic's error locations as type names; they are not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


class APIError(Exception):
    """An error answered to the client with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"retry-after": "1"} if self.status == 503 else None
        return _ErrorResponse(self.body(), status_code=self.status, headers=headers)


class _ErrorResponse(JSONResponse):
    """An error body always renders: one that echoes text UTF-8 cannot carry (a lone surrogate
    the request checks missed) is sent with that text escaped, still valid JSON."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def _param_of_location(location: tuple) -> str | None:
    parts = [str(part) for part in location
             if isinstance(part, int) or (_FIELD_NAME.match(str(part)) and part not in _TYPE_TAGS)]
    return ".".join(parts) or None


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, naming the field (``messages.0.content``) it is in."""
    first = error.errors()[0]
    param = _param_of_location(first["loc"])
    if first["type"] == "missing":
        return bad_request(f"'{param}' is a required field", param=param, code="missing_required_parameter")
    got = first.get("input")
    shown = repr(got) if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
    message = f"invalid value for '{param}': {first['msg'][0].lower()}{first['msg'][1:]} (got {shown})"
    return bad_request(message[:1000], param=param, code="invalid_type")


def from_value_error(error: ValueError, default_param: str | None = None,
                     renamed: dict[str, str] | None = None) -> APIError:
    """SamplingParams and the engine start their messages with the field's name
    (``temperature must be >= 0``, ``logprobs=30 is more than ...``); ``renamed`` maps an
    engine field onto the request field the client sent (chat's ``top_logprobs``)."""
    from weir.sampling_params import SamplingParams

    message = str(error)
    first_word = re.split(r"[ =]", message, maxsplit=1)[0]
    param = first_word if first_word in SamplingParams.__dataclass_fields__ else default_param
    if renamed and param in renamed:
        if param == first_word:  # the message names the field sent too
            message = renamed[param] + message[len(first_word):]
        param = renamed[param]
    code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
    return bad_request(message, param=param, code=code)
