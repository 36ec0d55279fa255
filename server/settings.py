"""The server's own options (the engine's are ``EngineArgs``); light to import, for the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_MAX_NUM_QUEUED_REQS = 1024
DEFAULT_MAX_NUM_QUEUED_TOKENS = 1 << 20
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
DEFAULT_SHUTDOWN_GRACE_SECONDS = 10.0
# Connection limits (weir.server.connections): uvicorn's keep-alive default, a header deadline
# long enough for any real client, connections a few times past the requests in flight, h11's
# own header size limit.
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0
DEFAULT_TIMEOUT_HEADER = 10.0
DEFAULT_MAX_CONNECTIONS = 2 * DEFAULT_MAX_NUM_QUEUED_REQS
DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE = 16 << 10
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_LOG_STATS_INTERVAL = 10.0  # seconds between stats lines, as vLLM's
# Environment variables --api-key falls back to, in order: Weir's own, then vLLM's.
API_KEY_ENV_VARS = ("WEIR_API_KEY", "VLLM_API_KEY")


def parse_allowed_origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: a JSON list as vLLM takes it (``'["http://a.com"]'``), or
    comma-separated origins."""
    if not text.lstrip().startswith(("[", "{")):
        return tuple(origin.strip() for origin in text.split(",") if origin.strip())
    try:
        origins = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--allowed-origins {text!r} is not valid JSON: {error}") from None
    if not isinstance(origins, list) or not all(isinstance(origin, str) for origin in origins):
        raise ValueError(f"--allowed-origins {text!r} must be a JSON list of strings")
    return tuple(origins)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_num_queued_reqs: int = DEFAULT_MAX_NUM_QUEUED_REQS  # requests in flight at most
    max_num_queued_tokens: int = DEFAULT_MAX_NUM_QUEUED_TOKENS  # prompt tokens not yet started
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_SECONDS
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE  # an idle kept-alive connection is closed after it
    timeout_header: float = DEFAULT_TIMEOUT_HEADER  # a request's headers must arrive within it: else 408
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open at once; past it a new connection gets 503
    h11_max_incomplete_event_size: int = DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE  # incomplete headers, bytes
    uvicorn_log_level: str = "info"
    # Browser origins allowed to call the API (CORS); vLLM's default lets any origin in too.
    allowed_origins: tuple[str, ...] = ("*",)
    # Tool calling (vLLM's flags): the model's tool-call format, and whether tool_choice "auto" is served.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # "qwen3": <think>...</think> goes to reasoning_content
    # The periodic stats line (throughput, queue, KV cache), logged only while something happens.
    log_stats: bool = True
    log_stats_interval: float = DEFAULT_LOG_STATS_INTERVAL

    @property
    def auto_tool_call_parser(self) -> str | None:
        """The parser that serves tool_choice "auto", or None when the server does not serve it."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens", "max_request_body_bytes", "timeout_keep_alive",
                     "timeout_header", "max_connections", "h11_max_incomplete_event_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
        if isinstance(self.allowed_origins, str) or not all(isinstance(o, str) for o in self.allowed_origins):
            raise ValueError(f"allowed_origins must be a sequence of origins, got {self.allowed_origins!r}")
        from weir.server import reasoning
        from weir.server.tool_calls import PARSERS

        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning.PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(reasoning.PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser hermes)")
        if not self.log_stats_interval > 0:
            raise ValueError(f"log_stats_interval must be a positive number of seconds, got {self.log_stats_interval}")
        if self.shutdown_grace_seconds < 0:
            raise ValueError(f"shutdown_grace_seconds must be >= 0, got {self.shutdown_grace_seconds}")
