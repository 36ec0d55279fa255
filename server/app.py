"""The starlette app: routes, API-key check, OpenAI-shaped errors, per-endpoint metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from weir.server import info
from weir.server.chat import create_chat_completion
from weir.server.completions import create_completion
from weir.server.errors import APIError
from weir.server.metrics import StatsLogger
from weir.server.responses import create_response
from weir.server.settings import ServerSettings
from weir.server.state import ServerState
from weir.server.streaming import SHUTDOWN_ERROR, ClientDisconnected
from weir.streams import EngineClient

logger = logging.getLogger(__name__)

# Not an HTTP status a server sends; recorded in the metrics for clients that left (as nginx does).
CLIENT_CLOSED_REQUEST = 499


def _check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def _endpoint(state: ServerState, handler, path: str, protected: bool):
    """Wrap ``handler(request, state)``: every failure becomes an OpenAI error body; one request's
    exception never reaches the server itself."""

    async def endpoint(request: Request):
        try:
            if protected:
                _check_api_key(request, state.settings.api_key)
            response = await handler(request, state)
        except APIError as error:
            response = error.response()
        except (ClientDisconnected, ClientDisconnect):  # gone while we answered, or while it uploaded
            state.metrics.observe_http(path, CLIENT_CLOSED_REQUEST)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except asyncio.CancelledError:
            # uvicorn cancels handlers still running past the shutdown grace period; answer
            # (not re-raise) so the client learns why instead of seeing a cut connection.
            response = APIError(503, SHUTDOWN_ERROR["error"]["message"], code="server_shutting_down").response()
        except Exception as error:
            logger.exception("%s failed", path)
            response = APIError(500, f"internal error: {error!r}", code="internal_error").response()
        state.metrics.observe_http(path, response.status_code)
        return response

    return endpoint


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Unknown paths (404) and wrong methods (405), in OpenAI's shape too."""
    message = {404: f"no such endpoint: {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}
    return APIError(error.status_code, message.get(error.status_code, str(error.detail)),
                    code="not_found" if error.status_code == 404 else None).response()


def build_app(engine: EngineClient, settings: ServerSettings) -> Starlette:
    """The app serving ``engine``; its lifespan stops the engine when the server stops."""
    state = ServerState(engine, settings)
    table = [
        ("/v1/chat/completions", create_chat_completion, "POST", True),
        ("/v1/completions", create_completion, "POST", True),
        ("/v1/responses", create_response, "POST", True),
        ("/v1/models", info.list_models, "GET", True),
        ("/v1/models/{model:path}", info.retrieve_model, "GET", True),
        ("/tokenize", info.tokenize, "POST", True),
        ("/detokenize", info.detokenize, "POST", True),
        ("/health", info.health, "GET", False),
        ("/version", info.version, "GET", False),
        ("/metrics", info.metrics, "GET", False),
    ]
    routes = [Route(path, _endpoint(state, handler, path, protected), methods=[method])
              for path, handler, method, protected in table]

    state.metrics.follow_engine(engine.counters, state.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        stats = StatsLogger(engine, settings.log_stats_interval) if settings.log_stats else None
        stats_task = asyncio.create_task(stats.run(), name="weir-stats") if stats else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
        # uvicorn has already let in-flight requests finish (or cancelled them past the grace
        # period), so what is left to do is stop the engine thread.
        await engine.shutdown(grace_seconds=0.0)
        state.close()

    # Browser clients send a preflight OPTIONS first; without CORS headers they cannot call at all.
    cors = Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                      allow_headers=["*"])
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=lifespan,
                    middleware=[cors])
    app.state.weir = state
    return app
