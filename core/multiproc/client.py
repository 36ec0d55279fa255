"""``ProcessEngine``: ``AsyncLLMEngine``'s interface over an engine loop in its own process.

Served in one process, the engine loop and the event loop that streams every token to every
client take turns on one GIL, and each step's host work waits for the event loop's share. Here
the engine runs in a spawned process (``weir.multiproc.engine_loop``); this side keeps the
streams, a sender thread that pickles commands off the event loop (a long prompt would otherwise
block it until the engine reads), and a receiver thread that turns each step's deltas into
cumulative outputs and hands them to the event loops.

Invariant: every stream in ``_streams`` ends exactly once, by its finished output, an error, or
``CLOSED``; when the engine process goes away, for whatever reason, the receiver ends them all
and answers every pending command.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

from weir.multiproc.deltas import DeltaDecoder
from weir.multiproc.engine_loop import run_engine_process
from weir.sampling_params import SamplingParams
from weir.streams import (
    CLOSED,
    EngineClient,
    EngineCounters,
    EngineDeadError,
    EngineSummary,
    RequestFailedError,
    RequestStream,
    deliver_threadsafe,
)
from weir.tokenizer import start_loading_tokenizer

logger = logging.getLogger(__name__)

# The answer each command kind waits for (abort and stop wait for none).
_ANSWER_KINDS = {"add": "added", "call": "called"}
# weir serve's log lines, in both processes.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STOP_SENDER = object()


def _settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Answer ``future`` unless it is already done (its caller may have given up on it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _retrieve(future: asyncio.Future) -> None:
    """Read a wrapped answer's exception, so one its caller no longer awaits is not logged."""
    if not future.cancelled():
        future.exception()


class ProcessEngine(EngineClient):
    def __init__(self, model: str | None = None, options: dict | None = None, *,
                 log_level: int = logging.INFO, log_format: str = LOG_FORMAT,
                 on_start: Callable | None = None):
        """Start the engine process and wait until its engine is built. A start-up failure there
        is raised here with its own type (a ValueError for a bad option, ...)."""
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        commands_out, self._commands = context.Pipe(duplex=False)
        self._results, results_in = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_engine_process, name="weir-engine",
            args=(model, options or {}, log_level, log_format, on_start, commands_out, results_in), daemon=True)
        self._process.start()
        # The child's ends, closed here: once the child exits, reading its results sees EOF.
        commands_out.close()
        results_in.close()
        # Whatever becomes of this object, the engine process must not outlive this one (and
        # multiprocessing's own exit handler would wait for it forever): registered after that
        # handler, this runs before it.
        atexit.register(self._reap)
        try:
            self._start()
        except BaseException:  # a bad option, a Ctrl-C while the model loads, ...
            self._reap()
            raise

    def _start(self) -> None:
        # This side loads the tokenizer too (chat templates, token bytes), beside the engine's
        # start-up: from the config, which comes before the model loads.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weir-tokenizer") as pool:
            tokenizer = None
            while True:
                try:
                    message = self._results.recv()
                except EOFError:
                    self._process.join()
                    raise RuntimeError(f"the engine process exited with code {self._process.exitcode} "
                                       "while starting (see its log above)") from None
                if message[0] == "failed":
                    raise message[1]
                if message[0] == "config":
                    tokenizer = start_loading_tokenizer(message[1].model, pool)
                    continue
                _, self._config, self._summary = message
                break
            self._tokenizer = (tokenizer or start_loading_tokenizer(self._config.model, pool)).result()
        self.counters = EngineCounters()
        # By key: added on the event loop, removed there (a reader's close) or by the receiver.
        self._streams: dict[int, RequestStream] = {}
        self._decoders: dict[int, DeltaDecoder] = {}
        self._pending: dict[tuple[str, int], concurrent.futures.Future] = {}  # ("added"|"called", key)
        self._pending_lock = threading.Lock()
        self._keys = itertools.count()
        self._num_adding = 0  # adds sent and not yet answered (counted on the event loop)
        self._stopping = threading.Event()
        self._dead = threading.Event()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="weir-engine-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="weir-engine-receive", daemon=True)
        self._sender.start()
        self._receiver.start()

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> "ProcessEngine":
        return cls(model, options)

    @property
    def config(self):
        return self._config

    @property
    def tokenizer(self):
        return self._tokenizer

    def summary(self) -> EngineSummary:
        return self._summary

    @property
    def is_running(self) -> bool:
        return self._process.is_alive() and not self._stopping.is_set() and not self._dead.is_set()

    # ---- caller side (event loop) ------------------------------------------------------

    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Admit the request; raises its validation error (ValueError) here, before any output."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        key = next(self._keys)
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        stream.key = key
        added = self._expect("added", key)
        # Known before the engine sees the request: its first outputs may come with the answer.
        self._streams[key] = stream
        self._decoders[key] = DeltaDecoder(request_id)
        self._num_adding += 1  # shutdown's grace period waits for these too
        self._outbox.put(("add", key, request_id, prompt, params))
        try:
            await self._wait_for_engine(added)
        except asyncio.CancelledError:
            self._abort_stream(stream)
            raise
        except BaseException:
            self._forget(key)
            raise
        finally:
            self._num_adding -= 1
        return stream

    async def _wait_for_engine(self, future: concurrent.futures.Future):
        # asyncio.wait, not awaiting the wrapped future: cancelling the caller must not cancel
        # the future the receiver thread will answer.
        waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(_retrieve)
        await asyncio.wait({waiting})
        return waiting.result()

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine process; ``fn`` and its result must pickle (a
        module-level function: ``weir.server.metrics.read_engine_stats``)."""
        if not self.is_running:
            done = concurrent.futures.Future()
            done.set_exception(EngineDeadError("the engine loop is not running"))
            return done
        seq = next(self._keys)
        done = self._expect("called", seq)
        self._outbox.put(("call", seq, fn))
        return done

    def abort(self, request_id: str) -> None:
        """Abort the request now known by this id; its reader's iteration ends."""
        self._outbox.put(("abort", request_id, None))

    def _abort_stream(self, stream: RequestStream) -> None:
        self._forget(stream.key)
        self._outbox.put(("abort", stream.request_id, stream.key))

    async def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Let in-flight requests finish for up to ``grace_seconds``, then abort the rest."""
        await self._drain(grace_seconds)
        self._stopping.set()
        self._outbox.put(("stop",))
        await asyncio.to_thread(self._process.join, 30)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within 30 s; killing it")
        self._reap()
        self._outbox.put(_STOP_SENDER)
        await asyncio.to_thread(self._receiver.join, 30)

    def _reap(self) -> None:
        """Make sure the engine process ends: closing the command pipe makes it stop by itself."""
        atexit.unregister(self._reap)
        self._commands.close()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)

    # ---- sender and receiver threads ---------------------------------------------------

    def _expect(self, kind: str, key: int) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._pending_lock:
            if self._dead.is_set():
                future.set_exception(EngineDeadError("the engine loop is not running"))
            else:
                self._pending[(kind, key)] = future
        return future

    def _forget(self, key: int) -> None:
        self._streams.pop(key, None)
        self._decoders.pop(key, None)

    def _send_loop(self) -> None:
        while True:
            command = self._outbox.get()
            if command is _STOP_SENDER:
                return
            try:
                payload = ForkingPickler.dumps(command)
            except Exception as error:  # e.g. call() of a lambda: that caller hears of it, the rest go on
                self._answer((_ANSWER_KINDS.get(command[0]), command[1]), error=error)
                continue
            try:
                self._commands.send_bytes(payload)
            except (OSError, ValueError):  # the engine process is gone; the receiver fails everyone
                return

    def _receive_loop(self) -> None:
        message = ("dead", "the engine process exited")
        try:
            while True:
                message = self._results.recv()
                if message[0] == "dead":
                    break
                self._handle(message)
        except (EOFError, OSError):
            code = self._process.exitcode
            message = ("dead", "the engine process exited" + (f" with code {code}" if code else ""))
        except BaseException as error:  # a bug here: fail everyone rather than hang them
            logger.exception("the engine receiver died")
            message = ("dead", f"the engine receiver died: {error!r}")
        try:
            self._dead.set()
            self._fail(list(self._streams), EngineDeadError(message[1]))
            with self._pending_lock:
                pending, self._pending = self._pending, {}
            for future in pending.values():
                _settle(future, error=EngineDeadError(message[1]))
        finally:
            self._outbox.put(_STOP_SENDER)

    def _answer(self, pending_key: tuple, result=None, error: BaseException | None = None) -> None:
        with self._pending_lock:
            future = self._pending.pop(pending_key, None)
        if future is not None:
            _settle(future, result, error)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            deliveries: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
            for delta in message[1]:
                stream, decoder = self._streams.get(delta.key), self._decoders.get(delta.key)
                if stream is None or decoder is None:
                    continue  # closed meanwhile
                output = decoder.decode(delta)
                self.counters.count(stream, output)
                if output.finished:
                    self._forget(delta.key)
                deliveries[stream.loop].append((stream, output))
            for loop, items in deliveries.items():
                deliver_threadsafe(loop, items)
        elif kind in ("added", "called"):
            self._answer((kind, message[1]), message[2] if kind == "called" else None, message[-1])
        elif kind == "failed_requests":
            self._fail(message[1], RequestFailedError(message[2]))
        elif kind == "closed":
            stream = self._streams.get(message[1])
            self._forget(message[1])
            if stream is not None:
                deliver_threadsafe(stream.loop, [(stream, CLOSED)])

    def _fail(self, keys, error: BaseException) -> None:
        deliveries: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for key in keys:
            stream = self._streams.get(key)
            self._forget(key)
            if stream is not None:
                deliveries[stream.loop].append((stream, error))
        for loop, items in deliveries.items():
            deliver_threadsafe(loop, items)
