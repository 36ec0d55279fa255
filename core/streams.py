"""What both engine clients share (``weir.async_engine.AsyncLLMEngine``'s thread and
``weir.multiproc.ProcessEngine``'s process): a request's stream, the errors its reader sees, the
counters and the start-up summary. It imports nothing heavy: with the engine in a process of its
own, the server's process never imports torch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weir.outputs import RequestOutput

if TYPE_CHECKING:
    from weir.engine import LLMEngine


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests go on."""


CLOSED = object()  # put in a stream that was closed or aborted: its reader stops


@dataclass
class EngineCounters:
    """Running totals bumped once per step by the thread that delivers outputs, for the stats
    line and /metrics. Plain ints, so any thread may read them without a lock (each read is one
    whole value)."""

    prompt_tokens: int = 0  # prompts of requests whose first token came out: their prefill is done
    generation_tokens: int = 0

    def count(self, stream: "RequestStream", output: RequestOutput) -> None:
        """Count ``output``, the newest of ``stream``'s request, before it is delivered."""
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_tokens and not stream.num_tokens_delivered:
            self.prompt_tokens += len(output.prompt_token_ids)
        self.generation_tokens += num_tokens - stream.num_tokens_delivered
        stream.num_tokens_delivered = num_tokens


@dataclass(frozen=True)
class EngineSummary:
    """What the start-up log says of a running engine, read once it is built."""

    platform: str
    backends: str  # layer kind=backend, for each kind the model has
    kv_cache_tokens: int
    usable_blocks: tuple[int, ...]  # per KV-cache group
    max_running_reqs: int  # max_num_seqs, or fewer where a hybrid model's state slots are fewer

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSummary:
        kv_cache = engine.scheduler.kv_cache
        return cls(engine.platform.name, engine.runner.caches.describe_backends(), kv_cache.capacity_tokens,
                   tuple(pool.num_usable_blocks for pool in kv_cache.pools), engine.runner.max_running_reqs)


class RequestStream:
    """One admitted request's outputs, each cumulative (text and token ids so far).

    Iterate it; ``close()`` (also on cancellation) aborts the request if it has not finished,
    which frees its KV blocks on the engine's next command pass, and ends the iteration of a
    reader waiting in another task. Outputs are cumulative, so the stream keeps only the newest
    one not yet read: a reader that falls behind holds one output, not every step's copy."""

    def __init__(self, engine, request_id: str, loop: asyncio.AbstractEventLoop):
        """``engine``: the client (``AsyncLLMEngine`` or ``ProcessEngine``) whose
        ``_abort_stream`` a close calls."""
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self._unread: object = None  # the newest RequestOutput, an exception that ends it, or CLOSED
        self._ready = asyncio.Event()
        self.finished = False
        self.key: int | None = None  # a ProcessEngine's name for this stream (request ids can repeat)
        self.num_tokens_delivered = 0  # over all completions; touched by the delivering thread only

    def put(self, item: object) -> None:
        """On the stream's event loop: a new output, an exception or CLOSED. An ending that is
        waiting to be read is kept; anything else replaces what is unread."""
        if self._unread is CLOSED or isinstance(self._unread, BaseException):
            return
        self._unread = item
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        item, self._unread = self._unread, None
        self._ready.clear()
        if item is CLOSED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._abort_stream(self)
            self.put(CLOSED)


class EngineClient:
    """What both clients do alike over their own ``add_request``, ``call`` and
    ``_wait_for_engine``; each keeps ``_streams`` (one entry per unended stream) and
    ``_num_adding`` (adds sent, not yet answered)."""

    _streams: dict
    _num_adding: int

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative) until it finishes. Cancelling the consumer
        (a client that went away) aborts the request and frees its blocks at once."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def call_async(self, fn):
        """``call`` awaited on the event loop."""
        return await self._wait_for_engine(self.call(fn))

    async def _drain(self, grace_seconds: float) -> None:
        """Shutdown's grace period: wait, up to ``grace_seconds``, for every stream to end and
        every add to be answered, while the engine still runs."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        while (self._streams or self._num_adding) and loop.time() < deadline and self.is_running:
            await asyncio.sleep(0.05)


def deliver_threadsafe(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Hand a step's outputs to one event loop with one wake-up (not one per request)."""
    def deliver() -> None:
        for stream, item in items:
            stream.put(item)

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # that loop is closed: its consumers are gone
        pass
