"""Server-sent events, and noticing a client that went away.

A client that disconnects must abort its request at once, not at the next token: both the SSE
response and ``run_until_disconnect`` watch the ASGI ``receive`` channel for
``http.disconnect`` and cancel the work when it comes (cancellation closes the generation,
which aborts it in the engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.types import Receive, Scope, Send

from weir.server.shapes import engine_error

logger = logging.getLogger(__name__)

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DONE_EVENT = b"data: [DONE]\n\n"
SHUTDOWN_ERROR = {"error": {"message": "the server is shutting down; this request was aborted",
                            "type": "server_error", "param": None, "code": "server_shutting_down"}}


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


def sse_event(payload: dict) -> bytes:
    """One event; NaN has no JSON form, so a payload holding one raises instead of sending it."""
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable):
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (shutdown past its grace period)
        watcher.cancel()
        client_left = not work_task.done()
        if client_left:
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if client_left:
        raise ClientDisconnected()
    return work_task.result()


async def final_outputs(receive: Receive, work: Awaitable, close: Callable[[], None]):
    """A non-streaming request's outputs (``work``): ClientDisconnected if the client hangs up
    first, the engine's failure as the server's APIError; ``close`` runs in every case."""
    try:
        return await run_until_disconnect(receive, work)
    except ClientDisconnected:
        raise
    except Exception as error:
        raise engine_error(error) from error
    finally:
        close()


async def finish_despite_cancel(cleanup: Awaitable[None]) -> bool:
    """Await ``cleanup`` to its end even if this task is cancelled meanwhile (it runs as a task of
    its own, shielded); True if a cancel arrived, which the caller then honours after it."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            return cancelled
        except asyncio.CancelledError:
            if task.done():  # the cleanup itself was cancelled, not this task
                raise
            cancelled = True


class EventStreamResponse:
    """An ASGI response streaming ``events`` (already-encoded SSE bytes); on disconnect the
    stream is cancelled and ``events`` closed, and ``on_close`` runs in every case. When the
    server cancels it (shutdown past the grace period) the client gets an error event and
    ``[DONE]`` rather than a cut connection."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self._started = self._ended = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.ensure_future(self._send_events(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        cancelled = False
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            cancelled = True
        finally:
            client_left = watcher.done()
            # The server's cancel may also land while this cleans up (the stream ended just as
            # the grace period ran out): it must still run to the end, and count as cancelled.
            cancelled |= await finish_despite_cancel(self._close(producer, watcher))
        if cancelled and self._started and not self._ended and not client_left:
            # Deliberately not re-raised: this is the handler's last act, and the server only
            # cancels handlers when it is stopping.
            try:
                await asyncio.wait_for(self._finish(send, sse_event(SHUTDOWN_ERROR) + DONE_EVENT), 1.0)
            except (OSError, asyncio.TimeoutError):
                pass

    async def _close(self, producer: asyncio.Future, watcher: asyncio.Future) -> None:
        for task in (producer, watcher):
            task.cancel()
        results = await asyncio.gather(producer, watcher, return_exceptions=True)
        if isinstance(results[0], Exception):
            logger.error("streaming a response failed", exc_info=results[0])
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()
        if self.on_close is not None:
            self.on_close()

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self._started = True
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except OSError:  # the connection broke under a write: same as a disconnect
            return
        await self._finish(send, b"")

    async def _finish(self, send: Send, last_body: bytes) -> None:
        self._ended = True
        await send({"type": "http.response.body", "body": last_body, "more_body": False})
