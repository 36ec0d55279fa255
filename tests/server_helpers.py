"""Test helpers for ``weir serve``: a real server process on 127.0.0.1, plain HTTP calls, an
asyncio SSE client that can hang up at any point, and the Prometheus text parser."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

SERVED_NAME = "tiny"
_URL_LINE = re.compile(r"serving the OpenAI API at http://127\.0\.0\.1:(\d+)/v1")


class ServerProcess:
    """``weir serve MODEL --port 0 ...`` in a subprocess; its log goes to a file (a pipe nobody
    reads would fill up and block the server)."""

    def __init__(self, model_path: Path, log_path: Path, *extra_args: str, env: dict | None = None,
                 wait: bool = True, device: str = "cpu"):
        self.log_path = log_path
        command = [sys.executable, "-m", "weir.cli.main", "serve", str(model_path), "--host", "127.0.0.1",
                   "--port", "0", "--device", device, "--served-model-name", SERVED_NAME,
                   "--max-model-len", "256", "--uvicorn-log-level", "warning", *extra_args]
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        self.port = self.wait_ready() if wait else None

    def wait_ready(self, timeout: float = 90) -> int:
        """Wait until the log names the URL and /health answers; returns the port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _URL_LINE.search(self.log_path.read_text())
            if match and self._health(int(match.group(1))) == 200:
                self.port = int(match.group(1))
                return self.port
            if self.process.poll() is not None:
                raise RuntimeError(f"weir serve exited with {self.process.returncode}:\n{self.log()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"weir serve did not start within {timeout} s:\n{self.log()}")

    @staticmethod
    def _health(port: int) -> int | None:
        try:
            return request("GET", port, "/health", timeout=5)[0]
        except OSError:
            return None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


def request(method: str, port: int, path: str, body=None, headers: dict | None = None,
            timeout: float = 60) -> tuple[int, object]:
    """One HTTP request; ``body`` is JSON-encoded unless it is bytes. Returns (status, JSON or text)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        all_headers = {"content-type": "application/json", **(headers or {})}
        connection.request(method, path, body=payload, headers=all_headers)
        response = connection.getresponse()
        raw = response.read().decode()
        try:
            return response.status, json.loads(raw)
        except json.JSONDecodeError:
            return response.status, raw
    finally:
        connection.close()


def scrape_metrics(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus-client: (name, sorted labels) -> value."""
    status, text = request("GET", port, "/metrics")
    assert status == 200, text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class StreamResult:
    status: int
    events: list = field(default_factory=list)  # parsed JSON payloads, [DONE] excluded
    done: bool = False  # saw data: [DONE]
    disconnected: bool = False  # we hung up on purpose
    last_event_time: float | None = None  # time.monotonic() of the last event read
    error_body: object = None


async def stream_sse(port: int, path: str, body: dict, hang_up_after: int | None = None,
                     headers: dict | None = None, timeout: float = 120,
                     first_event: asyncio.Event | None = None) -> StreamResult:
    """POST ``body`` and read its event stream; with ``hang_up_after=k``, close the socket after k
    events (0: right after the response headers). ``first_event`` is set when one arrives."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    writer.write(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n{extra}"
                 f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    try:
        return await asyncio.wait_for(_read_stream(reader, hang_up_after, first_event), timeout)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def _read_stream(reader: asyncio.StreamReader, hang_up_after: int | None,
                       first_event: asyncio.Event | None) -> StreamResult:
    status = int((await reader.readline()).split()[1])
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
    result = StreamResult(status)
    if status != 200:
        result.error_body = json.loads(await _read_body(reader, chunked))
        return result
    if hang_up_after == 0:
        result.disconnected = True
        return result
    buffer = b""
    async for data in _chunks(reader, chunked):
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            payload = event.decode().removeprefix("data: ")
            if payload == "[DONE]":
                result.done = True
                continue
            result.events.append(json.loads(payload))
            result.last_event_time = time.monotonic()
            if first_event is not None:
                first_event.set()
            if hang_up_after is not None and len(result.events) >= hang_up_after:
                result.disconnected = True
                return result
    return result


async def _chunks(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readline()


async def _read_body(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    return b"".join([data async for data in _chunks(reader, chunked)])


def wait_until(condition, timeout: float, interval: float = 0.1):
    """Poll ``condition()`` until it returns a truthy value; return the last value either way."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def stop_signal(name: str) -> int:
    return {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}[name]
