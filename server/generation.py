"""One engine request as the handlers see it: its outputs, its admission ticket, its metrics.

``Generation`` is closed exactly once, whatever ends it (finished, client gone, error): closing
an unfinished one aborts it in the engine and frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from weir.outputs import RequestOutput
from weir.server.admission import AdmissionTicket
from weir.server.metrics import RequestRecord, ServerMetrics
from weir.streams import RequestStream


class Generation:
    def __init__(self, stream: RequestStream, ticket: AdmissionTicket, record: RequestRecord,
                 metrics: ServerMetrics):
        self.stream = stream
        self.ticket = ticket
        self.record = record
        self.metrics = metrics
        self.latest: RequestOutput | None = None
        self.closed = False
        metrics.admitted(record)

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self.stream.__anext__()
        except StopAsyncIteration:
            self.close()
            raise
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception:
            self.close(reason="error")
            raise
        self.latest = output
        if self.metrics.tokens_arrived(self.record, [len(c.token_ids) for c in output.outputs]):
            self.ticket.started()
        if output.finished:
            self.close()
        return output

    async def final(self) -> RequestOutput:
        """Run to the end; returns the finished output."""
        async for _ in self:
            pass
        return self.latest

    def close(self, reason: str = "abort") -> None:
        """Idempotent. An unfinished request is aborted (``reason`` is what the metrics record)."""
        if self.closed:
            return
        self.closed = True
        self.stream.close()
        self.ticket.release()
        outputs = self.latest.outputs if self.latest is not None else []
        reasons = [c.finish_reason or reason for c in outputs] or [reason]
        self.metrics.finished(self.record, reasons, [len(c.token_ids) for c in outputs])


async def merge(generations: list[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several generations as they come: ``(index in the list, output)``."""
    if len(generations) == 1:
        async for output in generations[0]:
            yield 0, output
        return
    # Bounded: a pump whose consumer falls behind waits here and stops reading its stream, which
    # then keeps only its newest (cumulative) output instead of this queue keeping every one.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(generations))
    done = object()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for output in generation:
                await queue.put((index, output))
            await queue.put((index, done))
        except Exception as error:  # handed to the consumer, which re-raises it
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(index, g)) for index, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for generation in generations:
            generation.close()
