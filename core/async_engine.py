"""``AsyncLLMEngine``: the engine core loop on its own thread, driven from asyncio.

Callers on the event loop submit requests and read each one's outputs from its own queue; the
thread owns the ``LLMEngine`` (nothing else touches it), so many concurrent requests share its
batches without locks around the engine itself. Commands (add, abort) reach the thread through a
queue; outputs come back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from weir.engine import LLMEngine
from weir.outputs import RequestOutput
from weir.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests go on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput, or an exception that ends the stream


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weir-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_options(model, **options))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # ---- caller side (event loop) ------------------------------------------------------

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative) until it finishes. Cancelling the consumer
        (a client that went away) aborts the request and frees its blocks at once."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added = concurrent.futures.Future()
        self._commands.put(("add", request_id, prompt, params, stream, added))
        await asyncio.wrap_future(added)  # re-raises validation errors (ValueError) here
        finished = False
        try:
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn):
        """Run ``fn(engine)`` on the engine thread (for stats); returns a concurrent Future."""
        done = concurrent.futures.Future()
        self._commands.put(("call", fn, done))
        return done

    async def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Let in-flight requests finish for up to ``grace_seconds``, then abort the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._stopping.set()
        self._commands.put(("wake",))
        await asyncio.to_thread(self._thread.join, 30)

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                self._handle_commands(block=not busy)
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # a bug in the loop itself: fail everyone loudly
            logger.exception("engine loop died")
            self._fail_all(EngineDeadError(f"the engine loop died: {error!r}"))
            return
        self._fail_all(EngineDeadError("the engine is shutting down"))
        self._abort_all()

    def _handle_commands(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params, stream, added = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as error:
                    added.set_exception(error)
                    continue
                self._streams[request_id] = stream
                added.set_result(None)
            elif kind == "abort":
                if self._streams.pop(command[1], None) is not None:
                    self.engine.abort_request(command[1])
            elif kind == "call":
                _, fn, done = command
                try:
                    done.set_result(fn(self.engine))
                except Exception as error:
                    done.set_exception(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            # The step's failure cannot be pinned on one request of the batch: fail the ones in
            # it, free their state, and keep serving the ones that arrive next.
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(RequestFailedError(f"the engine failed while running this request: {error!r}"))
            self._abort_all()
            self.engine.reset_after_failure()
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, output)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)

    def _abort_all(self) -> None:
        request_ids = list(self._streams)
        self._streams.clear()
        self.engine.abort_request(request_ids)
