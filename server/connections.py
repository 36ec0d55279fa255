"""Limits on connections, enforced in uvicorn's HTTP protocol: a deadline for a request's headers,
a cap on open connections, and OpenAI-shaped answers to what is refused there (and Nagle's
algorithm off on every connection).

uvicorn closes a kept-alive connection that stays idle (``timeout_keep_alive``), but it has no
deadline for the headers of a request: a client that sends them a byte at a time, or connects
and sends nothing, holds its connection (and a socket) forever, and enough such clients starve
everyone else. Its ``limit_concurrency`` answers past the cap with a plain-text 503, and a
request that is not valid HTTP gets a plain-text 400. So the server runs a small subclass of
uvicorn's own protocol (h11, or httptools where installed): both keep the request being
answered in ``cycle`` and refuse bad HTTP through ``send_400_response``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from weir.server.errors import APIError
from weir.server.settings import ServerSettings

logger = logging.getLogger(__name__)


def _send_small_writes_at_once(transport: asyncio.Transport) -> None:
    """Turn Nagle's algorithm off, as asyncio does for the TCP sockets it opens itself. It skips
    sockets made without ``proto=IPPROTO_TCP``, such as the listening socket ``weir serve``
    binds; their accepted connections then held every write behind the ACK of the one before,
    which clients delay by up to 40 ms: a JSON response (headers, then body) took 40 ms more,
    and so could each event of a stream."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _ConnectionLimits:
    """Mixed in before uvicorn's protocol class; ``limits`` is set on the class that mixes it in."""

    limits: ServerSettings
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        _send_small_writes_at_once(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"the server has {self.limits.max_connections} connections open, its limit "
                              f"(--max-connections); retry later", "server_overloaded")
            return
        self._start_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self._between_requests():
            self._start_header_deadline()  # the first bytes of the next request on this connection
        super().data_received(data)
        if self._header_deadline is not None and not self._between_requests():
            self._cancel_header_deadline()  # its headers are in: the request is being answered

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}): a malformed request line "
                          f"or header, or headers over --h11-max-incomplete-event-size bytes", "invalid_http")

    def _between_requests(self) -> bool:
        """No request is being answered: the connection waits for (the rest of) a request's headers."""
        return self.cycle is None or self.cycle.response_complete

    def _start_header_deadline(self) -> None:
        self._header_deadline = self.loop.call_later(self.limits.timeout_header, self._headers_too_slow)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self._refuse(408, f"the request's headers did not arrive within {self.limits.timeout_header:g} s "
                              f"(--timeout-header)", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with OpenAI's error body and close: no request is being answered on
        this connection, so nothing else is written to it."""
        body = json.dumps(APIError(status, message, code=code).body(), separators=(",", ":")).encode()
        retry = "retry-after: 1\r\n" if status == 503 else ""
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{retry}connection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()


def connections_the_process_can_open(wanted: int) -> int:
    """Raise the soft limit on open files towards ``wanted`` sockets (as vLLM does) and return how
    many connections fit under it: past the limit ``accept`` fails before the cap's 503 can be
    sent. Some descriptors stay for what else the process opens (model files, the engine)."""
    import resource

    reserve = 128
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + reserve if hard == resource.RLIM_INFINITY else min(hard, wanted + reserve)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - reserve))


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """``uvicorn.Config`` arguments that put ``settings``' connection limits in force."""
    room = connections_the_process_can_open(settings.max_connections)
    if room < settings.max_connections:
        logger.warning("--max-connections %d is more than the open-file limit allows: at most %d connections "
                       "(raise it with ulimit -n)", settings.max_connections, room)
        settings = dataclasses.replace(settings, max_connections=room)
    protocol = type("WeirHTTPProtocol", (_ConnectionLimits, AutoHTTPProtocol), {"limits": settings})
    return {"http": protocol, "timeout_keep_alive": settings.timeout_keep_alive,
            "h11_max_incomplete_event_size": settings.h11_max_incomplete_event_size}
