"""``weir serve``: the OpenAI-compatible HTTP server (starlette + uvicorn) over one engine."""

from __future__ import annotations

import logging
import signal
import socket

import typer

from weir.cli.engine_options import with_engine_options
from weir.server.settings import (
    API_KEY_ENV_VARS,
    DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
    DEFAULT_LOG_STATS_INTERVAL,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_NUM_QUEUED_REQS,
    DEFAULT_MAX_NUM_QUEUED_TOKENS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    DEFAULT_TIMEOUT_HEADER,
    DEFAULT_TIMEOUT_KEEP_ALIVE,
    ServerSettings,
    parse_allowed_origins,
)

logger = logging.getLogger("weir.serve")


def _bind(host: str, port: int) -> socket.socket:
    """Bind here, before uvicorn starts, so port 0 works and the logged URL names the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from error
    return sock


def _log_start(engine, sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    config, summary = engine.config, engine.summary()
    logger.info("model %s (%s, %s) served as %r, max_model_len %d", config.model.model,
                config.model.architecture, str(config.model.dtype).removeprefix("torch."),
                config.model.served_model_name, config.scheduler.max_model_len)
    max_num_seqs = config.scheduler.max_num_seqs
    running = (f" ({summary.max_running_reqs} run at once: one linear-attention state slot each)"
               if summary.max_running_reqs < max_num_seqs else "")
    logger.info("platform %s, backends %s, KV cache %d tokens (%s usable blocks of %d), max_num_seqs %d%s",
                summary.platform, summary.backends, summary.kv_cache_tokens,
                " + ".join(map(str, summary.usable_blocks)), config.cache.block_size, max_num_seqs, running)
    logger.info("Weir is serving the OpenAI API at %s/v1 (metrics at %s/metrics)", url, url)
    return url


@with_engine_options
def serve(
    model: str | None = typer.Argument(None, metavar="MODEL",
                                       help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, min=0, max=65535, help="port to listen on (0: any free port)"),
    api_key: str | None = typer.Option(None, envvar=list(API_KEY_ENV_VARS), show_envvar=False,
                                       help="require 'Authorization: Bearer KEY' on /v1 (default: env "
                                            "WEIR_API_KEY, else VLLM_API_KEY)"),
    max_num_queued_reqs: int = typer.Option(DEFAULT_MAX_NUM_QUEUED_REQS,
                                            help="requests in flight at most; past it: 503"),
    max_num_queued_tokens: int = typer.Option(DEFAULT_MAX_NUM_QUEUED_TOKENS,
                                              help="prompt tokens waiting for prefill at most; past it: 503"),
    max_request_body_bytes: int = typer.Option(DEFAULT_MAX_REQUEST_BODY_BYTES,
                                               help="larger request bodies get 413"),
    timeout_keep_alive: float = typer.Option(DEFAULT_TIMEOUT_KEEP_ALIVE,
                                             help="seconds an idle kept-alive connection stays open"),
    timeout_header: float = typer.Option(DEFAULT_TIMEOUT_HEADER,
                                         help="seconds a client has to send a request's headers (from "
                                              "connecting, or from its first byte), and then its body; past "
                                              "it: 408"),
    max_connections: int = typer.Option(DEFAULT_MAX_CONNECTIONS,
                                        help="connections open at once; past it a new one gets 503"),
    h11_max_incomplete_event_size: int = typer.Option(DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
                                                      help="bytes of a request's headers buffered while "
                                                           "they are incomplete; past it: 400"),
    shutdown_grace_seconds: float = typer.Option(DEFAULT_SHUTDOWN_GRACE_SECONDS,
                                                 help="on SIGINT/SIGTERM, how long in-flight requests may "
                                                      "run on before they are aborted"),
    uvicorn_log_level: str = typer.Option("info", help="uvicorn's log level (critical ... trace)"),
    allowed_origins: str = typer.Option("*", help="browser origins allowed to call the API (CORS): a JSON "
                                                  "list as vLLM takes it, or comma-separated; '*': any"),
    enable_auto_tool_choice: bool = typer.Option(False, help="serve tool_choice 'auto': parse the model's tool "
                                                             "calls into tool_calls (needs --tool-call-parser)"),
    tool_call_parser: str | None = typer.Option(None, help="the model's tool-call format: hermes (Qwen, "
                                                          "NousResearch: <tool_call>{json}</tool_call>)"),
    reasoning_parser: str | None = typer.Option(None, help="qwen3: a reply's <think>...</think> part goes to "
                                                          "the message's reasoning_content"),
    # Stats logging, named as vLLM's.
    disable_log_stats: bool = typer.Option(False, "--disable-log-stats",
                                           help="no periodic stats line (throughput, running/waiting, KV cache)"),
    log_stats_interval: float = typer.Option(DEFAULT_LOG_STATS_INTERVAL, envvar="VLLM_LOG_STATS_INTERVAL",
                                             help="seconds between stats lines (one is logged only when "
                                                  "requests ran in the interval)"),
    engine_in_process: bool = typer.Option(False, "--engine-in-process",
                                           help="run the engine loop on a thread of the server's process, not "
                                                "in a process of its own (to debug or profile it there)"),
    engine_options: dict | None = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    import uvicorn

    from weir.multiproc import LOG_FORMAT, ProcessEngine
    from weir.process import set_step_loop_gc_thresholds
    from weir.server.app import build_app
    from weir.server.connections import uvicorn_options

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        settings = ServerSettings(host=host, port=port, api_key=api_key or None,
                                  max_num_queued_reqs=max_num_queued_reqs,
                                  max_num_queued_tokens=max_num_queued_tokens,
                                  max_request_body_bytes=max_request_body_bytes,
                                  timeout_keep_alive=timeout_keep_alive, timeout_header=timeout_header,
                                  max_connections=max_connections,
                                  h11_max_incomplete_event_size=h11_max_incomplete_event_size,
                                  shutdown_grace_seconds=shutdown_grace_seconds,
                                  uvicorn_log_level=uvicorn_log_level,
                                  allowed_origins=parse_allowed_origins(allowed_origins),
                                  enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                                  reasoning_parser=reasoning_parser, log_stats=not disable_log_stats,
                                  log_stats_interval=log_stats_interval)
        sock = _bind(host, port)
        set_step_loop_gc_thresholds()
        if engine_in_process:
            from weir.async_engine import AsyncLLMEngine

            engine = AsyncLLMEngine.from_options(model, **(engine_options or {}))
        else:
            engine = ProcessEngine(model, engine_options)
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    _log_start(engine, sock, host)
    config = uvicorn.Config(build_app(engine, settings), log_level=uvicorn_log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_grace_seconds, **uvicorn_options(settings))
    # uvicorn re-raises the SIGINT/SIGTERM it shut down for once it is done, into the handlers
    # that were installed before it: make those no-ops, so a graceful shutdown exits with 0.
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, lambda signum, frame: None)
    uvicorn.Server(config).run(sockets=[sock])
    logger.info("server stopped")
