"""The engine process of a ``ProcessEngine``: builds the ``LLMEngine`` and runs its loop.

The loop is ``AsyncLLMEngine``'s, with pipes for its queues: commands come from the server's
process, and each step's outputs go back to it as one message of deltas. Its host work between
device steps (scheduling, sampling bookkeeping, detokenizing) then holds a GIL of its own, not
the one the server's event loop spends on every streamed token.

Messages to the server, each a tuple. At start: ``("config", config)`` once the config is made,
then ``("ready", config, summary)``, or ``("failed", error)`` at any point. Then
``("added", key, error)``, ``("called", seq, result, error)``, ``("outputs", [OutputDelta])``,
``("failed_requests", [key], message)``, ``("closed", key)`` for a request aborted by id, and
last ``("dead", message)``.
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING

from weir.multiproc.deltas import DeltaEncoder
from weir.process import set_step_loop_gc_thresholds
from weir.streams import EngineSummary

if TYPE_CHECKING:
    from weir.engine import LLMEngine

logger = logging.getLogger(__name__)


def portable_error(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (the server re-raises it as it is, so its type still
    tells a validation error from a fault), else a ValueError or RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return (ValueError if isinstance(error, ValueError) else RuntimeError)(str(error))


def run_engine_process(model: str | None, options: dict, log_level: int, log_format: str,
                       on_start: Callable[[LLMEngine], None] | None,
                       commands: Connection, results: Connection) -> None:
    """The process's target. ``on_start(engine)`` runs once the engine is built (a module-level
    function, so it pickles: benchmarks and tests wrap the engine's steps with it)."""
    from weir.engine import LLMEngine  # here, not at the top: the server's process imports this module
    # The server's process decides when to stop (it lets requests drain first): a Ctrl-C sent
    # to the whole process group must not kill the engine under it. SIGTERM still ends it, as
    # multiprocessing's terminate() expects.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=log_format)
    set_step_loop_gc_thresholds()
    try:
        engine = LLMEngine.from_options(model, on_config=lambda config: results.send(("config", config)), **options)
        if on_start is not None:
            on_start(engine)
    except BaseException as error:
        results.send(("failed", portable_error(error)))
        return
    results.send(("ready", engine.config, EngineSummary.of(engine)))
    _EngineLoop(engine, commands, results).run()


class _ResultSender:
    """Sends the loop's messages from a thread of its own. The server's process reads them on a
    thread that shares its GIL with an event loop busy streaming tokens; while it lags, the pipe
    fills, and the engine loop must not wait on that between device steps."""

    def __init__(self, results: Connection):
        self._results = results
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._broken = False
        self._thread = threading.Thread(target=self._run, name="weir-engine-results", daemon=True)
        self._thread.start()

    def send(self, message: tuple | memoryview) -> None:
        """Queue a message (or one already pickled); raises once the server stopped reading."""
        if self._broken:
            raise BrokenPipeError("the server's process stopped reading the engine's results")
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop (the process exits next, daemon threads with it)."""
        self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                payload = message if isinstance(message, memoryview) else ForkingPickler.dumps(message)
                self._results.send_bytes(payload)
            except OSError:  # the server's process is gone: the loop stops at its next send
                self._broken = True
                return
            except Exception:  # a message that does not pickle: a bug, said loudly, and the loop stops too
                logger.exception("cannot send the engine's results")
                self._broken = True
                return


class _EngineLoop:
    def __init__(self, engine: LLMEngine, commands: Connection, results: Connection):
        self.engine = engine
        self.commands = commands
        self.results = _ResultSender(results)
        self.keys: dict[str, int] = {}  # request id -> the server's key for its stream
        self.deltas = DeltaEncoder()

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.results.close()

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
        except (EOFError, OSError):  # the server's process is gone: nobody to serve
            self.engine.abort_request(list(self.keys))
            return
        except BaseException as error:  # a bug in the loop itself: fail everyone loudly
            logger.exception("engine loop died")
            self._send_last(("dead", f"the engine loop died: {error!r}"))
            return
        self.engine.abort_request(list(self.keys))
        self._send_last(("dead", "the engine is shutting down"))

    def _send_last(self, message: tuple) -> None:
        try:
            self.results.send(message)
        except OSError:
            pass

    def _handle_commands(self, block: bool) -> bool:
        """Run the commands that have arrived (waiting for one if ``block``); False on stop."""
        while block or self.commands.poll():
            block = False
            command = self.commands.recv()
            kind = command[0]
            if kind == "add":
                _, key, request_id, prompt, params = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as error:
                    self.results.send(("added", key, portable_error(error)))
                    continue
                self.keys[request_id] = key
                self.results.send(("added", key, None))
            elif kind == "abort":
                _, request_id, key = command
                current = self.keys.get(request_id)
                # By stream key: only the request that stream named, not a newer one with its id.
                if current is not None and (key is None or key == current):
                    del self.keys[request_id]
                    self.deltas.forget(current)
                    self.engine.abort_request(request_id)
                    if key is None:
                        self.results.send(("closed", current))
            elif kind == "call":
                _, seq, fn = command
                try:
                    answer = ForkingPickler.dumps(("called", seq, fn(self.engine), None))
                except Exception as raised:  # raised by fn, or its result does not pickle
                    answer = ForkingPickler.dumps(("called", seq, None, portable_error(raised)))
                self.results.send(answer)
            elif kind == "stop":
                return False
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            # As AsyncLLMEngine: fail the requests that ran, keep serving the others.
            logger.exception("engine step failed; failing the requests that were running")
            failed = [self.keys.pop(request_id) for request_id in self.engine.reset_after_failure()
                      if request_id in self.keys]
            for key in failed:
                self.deltas.forget(key)
            self.results.send(("failed_requests", failed,
                               f"the engine failed while running this request: {error!r}"))
            return
        deltas = []
        for output in outputs:
            key = self.keys.get(output.request_id)
            if key is None:
                continue
            deltas.append(self.deltas.encode(key, output))
            if output.finished:
                del self.keys[output.request_id]
        if deltas:
            self.results.send(("outputs", deltas))
