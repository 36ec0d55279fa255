"""``AsyncLLMEngine``: the engine core loop on its own thread, driven from asyncio.

Callers on the event loop submit requests and read each one's outputs from its own queue; the
thread owns the ``LLMEngine`` (nothing else touches it), so many concurrent requests share its
batches without locks around the engine itself. Commands (add, abort, call) reach the thread
through a queue; each step's outputs go back to each event loop in one ``call_soon_threadsafe``.

``weir.multiproc.ProcessEngine`` has the same interface with the loop in its own process
(``weir serve`` uses it); ``weir.streams`` holds what both share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import defaultdict

from weir.engine import LLMEngine
from weir.sampling_params import SamplingParams
from weir.streams import (  # noqa: F401 (EngineDeadError and RequestFailedError: this module's API too)
    CLOSED,
    EngineClient,
    EngineCounters,
    EngineDeadError,
    EngineSummary,
    RequestFailedError,
    RequestStream,
    deliver_threadsafe,
)

logger = logging.getLogger(__name__)


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._num_adding = 0  # adds sent and not yet answered (counted on the event loop)
        self.counters = EngineCounters()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weir-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_options(model, **options))

    @property
    def config(self):
        """The engine's ``EngineConfig``."""
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def summary(self) -> EngineSummary:
        return EngineSummary.of(self.engine)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    # ---- caller side (event loop) ------------------------------------------------------

    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Admit the request; raises its validation error (ValueError) here, before any output."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        added = concurrent.futures.Future()
        self._num_adding += 1  # shutdown's grace period waits for these too
        self._commands.put(("add", prompt, params, stream, added))
        try:
            await self._wait_for_engine(added)
        except asyncio.CancelledError:
            self._abort_stream(stream)  # queued after the add, so it reaches the request it names
            raise
        finally:
            self._num_adding -= 1
        return stream

    async def _wait_for_engine(self, future: concurrent.futures.Future):
        """Await a command's answer; if the loop dies without answering, raise EngineDeadError."""
        waiting = asyncio.wrap_future(future)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=1.0)
            if done:
                return waiting.result()
            if not self._thread.is_alive():
                waiting.cancel()
                raise EngineDeadError("the engine loop stopped before answering")

    def abort(self, request_id: str) -> None:
        """Abort the request now known by this id; its reader's iteration ends."""
        self._commands.put(("abort", request_id, None))

    def _abort_stream(self, stream: RequestStream) -> None:
        """Abort ``stream``'s request, and nothing else: its id may name a newer request by the
        time the command runs (the old one finished and the id was reused)."""
        self._commands.put(("abort", stream.request_id, stream))

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread (for stats); returns a concurrent Future."""
        done = concurrent.futures.Future()
        if not self._thread.is_alive():
            done.set_exception(EngineDeadError("the engine loop is not running"))
            return done
        self._commands.put(("call", fn, done))
        return done

    async def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Let in-flight requests finish for up to ``grace_seconds``, then abort the rest."""
        await self._drain(grace_seconds)
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
            self._fail(list(self._streams), EngineDeadError(f"the engine loop died: {error!r}"))
            self._fail_pending_calls(error)
            return
        request_ids = list(self._streams)
        self._fail(request_ids, EngineDeadError("the engine is shutting down"))
        self.engine.abort_request(request_ids)
        self._fail_pending_calls(EngineDeadError("the engine is shutting down"))

    def _handle_commands(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = command[0]
            if kind == "add":
                _, prompt, params, stream, added = command
                try:
                    self.engine.add_request(stream.request_id, prompt, params)
                except Exception as error:
                    added.set_exception(error)
                    continue
                self._streams[stream.request_id] = stream
                added.set_result(None)
            elif kind == "abort":
                _, request_id, stream = command
                current = self._streams.get(request_id)
                if current is not None and (stream is None or current is stream):
                    del self._streams[request_id]
                    self.engine.abort_request(request_id)
                    if stream is None:  # aborted by id: wake the reader (close() woke its own)
                        deliver_threadsafe(current.loop, [(current, CLOSED)])
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
            # The step's failure cannot be pinned on one request of the batch: fail the ones
            # that ran, free their state, and keep serving the ones still waiting and those
            # that arrive next.
            logger.exception("engine step failed; failing the requests that were running")
            failed = self.engine.reset_after_failure()
            self._fail(failed, RequestFailedError(f"the engine failed while running this request: {error!r}"))
            return
        deliveries: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        counters = self.counters
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            counters.count(stream, output)
            if output.finished:
                del self._streams[output.request_id]
            deliveries[stream.loop].append((stream, output))
        for loop, items in deliveries.items():
            deliver_threadsafe(loop, items)

    def _fail(self, request_ids, error: BaseException) -> None:
        """Deliver ``error`` to these requests' streams and forget the streams (aborting the
        requests in the engine, where that is still needed, is the caller's part)."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                deliveries[stream.loop].append((stream, error))
        for loop, items in deliveries.items():
            deliver_threadsafe(loop, items)

    def _fail_pending_calls(self, error: BaseException) -> None:
        """Answer the commands nobody will run any more, so no caller waits forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] in ("add", "call"):
                command[-1].set_exception(EngineDeadError(f"the engine loop is not running: {error}"))
