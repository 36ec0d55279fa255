"""The engine clients' streams (AsyncLLMEngine's thread, ProcessEngine's process): who an abort
reaches, that a closed stream wakes its reader, what an unread stream keeps, and that shutdown's
grace period covers requests still being added."""

from __future__ import annotations

import asyncio
import gc

import pytest

from weir.async_engine import AsyncLLMEngine
from weir.multiproc import ProcessEngine
from weir.outputs import RequestOutput
from weir.sampling_params import SamplingParams

SHORT = SamplingParams(max_tokens=3, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(params=["thread", pytest.param("process", marks=pytest.mark.integration)])
def engine(request, tiny_llama_path):
    client = AsyncLLMEngine if request.param == "thread" else ProcessEngine
    async_engine = client.from_options(str(tiny_llama_path), device="cpu", max_model_len=256, block_size=4)
    yield async_engine
    asyncio.run(async_engine.shutdown())


async def wait_until_no_streams(engine) -> None:
    while engine.num_streams:
        await asyncio.sleep(0.01)


def test_closing_a_finished_stream_spares_a_newer_request_with_its_id(engine):
    async def scenario():
        old = await engine.add_request("X", "abc", SHORT)
        await wait_until_no_streams(engine)  # finished in the engine; its last output is unread
        new = await engine.add_request("X", "abc", LONG)
        old.close()  # its consumer goes away only now
        outputs = [output async for output in new]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 40

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_close_and_abort_end_a_reader_waiting_in_another_task(engine):
    async def read_all(stream):
        return [output async for output in stream]

    async def scenario():
        for end in ("close", "abort"):
            stream = await engine.add_request(end, "abc", SamplingParams(max_tokens=200, ignore_eos=True))
            reader = asyncio.create_task(read_all(stream))
            await asyncio.sleep(0.05)
            stream.close() if end == "close" else engine.abort(end)
            outputs = await asyncio.wait_for(reader, 10)  # the reader stops instead of hanging
            assert not outputs or not outputs[-1].finished
        await wait_until_no_streams(engine)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_unread_stream_keeps_only_its_newest_output(engine):
    async def scenario():
        stream = await engine.add_request("unread", "abc", LONG)
        await wait_until_no_streams(engine)  # every step's output delivered, none read
        await asyncio.sleep(0.05)  # the last delivery runs on this loop
        held = [obj for obj in gc.get_objects() if type(obj) is RequestOutput and obj.request_id == "unread"]
        assert len(held) == 1, f"{len(held)} outputs held for an unread stream"  # not one per step
        del held
        outputs = [output async for output in stream]
        assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 40

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_shutdown_grace_covers_requests_still_being_added(engine):
    async def scenario():
        adds = [asyncio.create_task(engine.add_request(f"q{index}", "abc", SHORT)) for index in range(3)]
        await asyncio.sleep(0)  # the adds are queued, none answered yet
        await engine.shutdown(grace_seconds=30)
        for add in adds:
            outputs = [output async for output in await add]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3

    asyncio.run(asyncio.wait_for(scenario(), 60))
