"""Graceful shutdown: SIGTERM/SIGINT stop new connections, let in-flight requests finish within
the grace period (or abort them past it), and exit 0."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from server_helpers import SERVED_NAME, ServerProcess, request, stream_sse

pytestmark = pytest.mark.integration

LONG_STREAM = {"model": SERVED_NAME, "prompt": "abc", "max_tokens": 64, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
NUM_STREAMS = 3


@pytest.fixture(scope="module")
def servers(tiny_llama_path, tmp_path_factory):
    """Two servers started side by side (start-up is mostly imports); one request at a time
    each (--max-num-seqs 1), so in-flight requests outlast the signal."""
    folder = tmp_path_factory.mktemp("serve")
    patient = ServerProcess(tiny_llama_path, folder / "patient.log", "--max-num-seqs", "1",
                            "--shutdown-grace-seconds", "60", wait=False)
    impatient = ServerProcess(tiny_llama_path, folder / "impatient.log", "--max-num-seqs", "1",
                              "--shutdown-grace-seconds", "0", wait=False)
    try:
        patient.wait_ready()
        impatient.wait_ready()
        yield patient, impatient
    finally:
        patient.kill()
        impatient.kill()


async def streams_then_signal(server: ServerProcess, sig: int):
    """Start NUM_STREAMS long streams, send ``sig`` once the first is generating; returns the
    results, when the signal went, and whether a new connection was refused afterwards."""
    first_event = asyncio.Event()
    tasks = [asyncio.create_task(stream_sse(server.port, "/v1/completions", LONG_STREAM,
                                            first_event=first_event if index == 0 else None))
             for index in range(NUM_STREAMS)]
    await asyncio.wait_for(first_event.wait(), 60)
    server.process.send_signal(sig)
    signalled_at = time.monotonic()
    refused = False
    deadline = time.monotonic() + 10
    while not refused and time.monotonic() < deadline:  # uvicorn checks for the signal every 0.1 s
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.close()
            await asyncio.sleep(0.05)
        except OSError:
            refused = True
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return results, signalled_at, refused


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_finishes_in_flight_requests_within_the_grace_period(servers, sig):
    server = servers[0] if sig == signal.SIGTERM else servers[1]
    assert request("GET", server.port, "/health")[0] == 200
    results, signalled_at, refused = asyncio.run(streams_then_signal(server, sig))
    assert server.stop(sig, timeout=60) == 0, server.log()
    assert refused
    assert all(result.status == 200 and result.done for result in results)  # all end with [DONE]
    finished = [result for result in results if "usage" in result.events[-1] and result.events[-1]["usage"]]
    if sig == signal.SIGTERM:  # grace 60 s: all of them finish, also those still queued at the signal
        assert len(finished) == NUM_STREAMS
        assert all(result.events[-1]["usage"]["completion_tokens"] == 64 for result in finished)
        assert max(result.last_event_time for result in finished) > signalled_at  # still generating then
    else:  # grace 0: the ones still running or queued are aborted, and told so
        aborted = [result for result in results if result not in finished]
        assert aborted
        assert all(result.events[-1]["error"]["code"] == "server_shutting_down" for result in aborted)
    assert "server stopped" in server.log() and "Traceback" not in server.log()
