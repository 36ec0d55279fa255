"""ProcessEngine: the engine loop in its own process. Its deltas rebuild the cumulative outputs
exactly; tokens match the in-process engine's; a bad request, a start-up failure, a failed step
and a dead engine process each reach the callers they concern, with their own error."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import SERVED_NAME, ServerProcess, request

from weir import LLM
from weir.async_engine import EngineDeadError, RequestFailedError
from weir.multiproc import ProcessEngine
from weir.multiproc.deltas import DeltaDecoder, DeltaEncoder
from weir.outputs import CompletionOutput, Logprob, RequestOutput
from weir.sampling_params import SamplingParams
from weir.server.metrics import read_engine_stats

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _output(texts, token_ids, finished=False, with_logprobs=True):
    completions = [CompletionOutput(index, text, list(ids), -0.5 * len(ids),
                                    [{t: Logprob(-0.5, 1, None)} for t in ids] if with_logprobs else None,
                                    "length" if finished else None)
                   for index, (text, ids) in enumerate(zip(texts, token_ids))]
    return RequestOutput("r", "prompt", [1, 2, 3], completions, finished, 2)


def test_deltas_rebuild_every_cumulative_output():
    # Two completions; the second one's text is not an extension of what was sent (it must be
    # replaced, not appended to); the last output finishes both.
    steps = [_output(["a", ""], [[5], []]),
             _output(["ab", "x"], [[5, 6], [9]]),
             _output(["ab\ufffd", "Y"], [[5, 6, 7], [9, 10]]),
             _output(["abcd", "YZ"], [[5, 6, 7, 8], [9, 10, 11]], finished=True)]
    encoder, decoder = DeltaEncoder(), DeltaDecoder("r")
    for step in steps:
        assert decoder.decode(encoder.encode(7, step)) == step
    assert not encoder._sent  # a finished request is forgotten
    # Without logprobs, and a first delta carries the prompt only once.
    first = encoder.encode(8, _output(["a"], [[5]], with_logprobs=False))
    second = encoder.encode(8, _output(["ab"], [[5, 6]], with_logprobs=False))
    assert first.prompt_token_ids == [1, 2, 3] and second.prompt_token_ids is None
    assert second.completions[0].token_ids == [6] and second.completions[0].logprobs is None


pytestmark_process = pytest.mark.integration


@pytest.fixture(scope="module")
def process_engine(tiny_llama_path):
    engine = ProcessEngine.from_options(str(tiny_llama_path), device="cpu", max_model_len=64, block_size=4)
    yield engine
    asyncio.run(engine.shutdown())


async def _collect(engine, request_id, prompt, params=GREEDY):
    return [output async for output in engine.generate(request_id, prompt, params)]


@pytestmark_process
def test_tokens_and_text_match_the_in_process_engine(process_engine, tiny_llama_path):
    prompts = [[3, 17, 40], [8, 8, 9, 10, 11], [100, 2]]

    async def scenario():
        return await asyncio.gather(*(_collect(process_engine, f"p{index}", {"prompt_token_ids": prompt})
                                      for index, prompt in enumerate(prompts)))

    streamed = asyncio.run(asyncio.wait_for(scenario(), 60))
    llm = LLM(str(tiny_llama_path), device="cpu", max_model_len=64, block_size=4)
    expected = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], GREEDY, use_tqdm=False)
    for outputs, reference in zip(streamed, expected):
        final = outputs[-1]
        assert final.finished and final.prompt_token_ids == reference.prompt_token_ids
        assert final.outputs[0].token_ids == reference.outputs[0].token_ids
        assert final.outputs[0].text == reference.outputs[0].text
        # Cumulative as the thread engine's: each output extends the one before.
        for before, after in zip(outputs, outputs[1:]):
            assert after.outputs[0].token_ids[: len(before.outputs[0].token_ids)] == before.outputs[0].token_ids


@pytestmark_process
def test_a_bad_request_fails_alone_and_calls_run_in_the_engine(process_engine):
    async def scenario():
        with pytest.raises(ValueError, match="max_model_len"):
            await process_engine.add_request("long", {"prompt_token_ids": list(range(80))}, GREEDY)
        outputs = await _collect(process_engine, "ok", {"prompt_token_ids": [1, 2, 3]})
        assert outputs[-1].finished
        return await process_engine.call_async(read_engine_stats)

    stats = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert process_engine.counters.generation_tokens >= GREEDY.max_tokens


def slow_call(engine) -> int:
    time.sleep(0.3)
    return engine.scheduler.num_running


@pytestmark_process
def test_callers_that_give_up_or_send_what_cannot_pickle_leave_the_engine_serving(process_engine):
    async def scenario():
        with pytest.raises(asyncio.TimeoutError):  # its answer comes after the caller gave up
            await asyncio.wait_for(process_engine.call_async(slow_call), 0.05)
        with pytest.raises(Exception, match="pickle"):
            await process_engine.call_async(lambda engine: 0)
        await asyncio.sleep(0.4)
        outputs = await _collect(process_engine, "still", {"prompt_token_ids": [1, 2, 3]})
        assert outputs[-1].finished and await process_engine.call_async(slow_call) == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert process_engine.is_running


@pytestmark_process
def test_a_start_up_failure_keeps_its_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ProcessEngine.from_options(str(tmp_path / "missing"), device="cpu")


class _FaultOnce:
    """Wraps the runner's execute: its third call raises, the others run."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("injected device fault")
        return self.inner(*args, **kwargs)


def inject_one_fault(engine) -> None:
    """``on_start`` hook (module level: it is pickled by name into the engine process)."""
    engine.runner.execute = _FaultOnce(engine.runner.execute)


@pytestmark_process
def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(tiny_llama_path):
    engine = ProcessEngine(str(tiny_llama_path), {"device": "cpu", "max_model_len": 64, "block_size": 4},
                           on_start=inject_one_fault)

    async def scenario():
        with pytest.raises(RequestFailedError, match="injected device fault"):
            await _collect(engine, "hit", {"prompt_token_ids": [1, 2, 3]})
        outputs = await _collect(engine, "after", {"prompt_token_ids": [1, 2, 3]})
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == GREEDY.max_tokens
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def slow_steps(engine) -> None:
    """``on_start`` hook: each step takes at least 50 ms, so a request runs long enough to be cut."""
    inner = engine.step

    def step():
        time.sleep(0.05)
        return inner()

    engine.step = step


@pytestmark_process
def test_a_dead_engine_process_ends_every_stream(tiny_llama_path):
    engine = ProcessEngine(str(tiny_llama_path), {"device": "cpu", "max_model_len": 64, "block_size": 4},
                           on_start=slow_steps)

    async def scenario():
        # A Ctrl-C reaches the whole process group; the engine leaves stopping to the server.
        os.kill(engine._process.pid, signal.SIGINT)
        stream = await engine.add_request("long", {"prompt_token_ids": [1, 2, 3]},
                                          SamplingParams(max_tokens=60, ignore_eos=True))
        assert engine.is_running
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("next", {"prompt_token_ids": [1]}, GREEDY)
        with pytest.raises(EngineDeadError):
            await engine.call_async(read_engine_stats)
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def _spawned_children(pid: int) -> list[str]:
    """Command lines of ``pid``'s children that multiprocessing spawned."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "multiprocessing.spawn" in cmdline:
                children.append(cmdline)
    return children


@pytestmark_process
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("in_process", [False, True])
def test_weir_serve_runs_its_engine_where_asked(tiny_llama_path, tmp_path, in_process):
    server = ServerProcess(tiny_llama_path, tmp_path / "server.log", *(["--engine-in-process"] if in_process else []))
    try:
        status, body = request("POST", server.port, "/v1/completions",
                               {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert len(_spawned_children(server.process.pid)) == (0 if in_process else 1)
    finally:
        assert server.stop() == 0, server.log()


@pytestmark_process
def test_a_program_that_never_shuts_its_engine_down_still_exits(tiny_llama_path):
    script = ("import sys; from weir.multiproc import ProcessEngine; "
              f"engine = ProcessEngine.from_options({str(tiny_llama_path)!r}, device='cpu', max_model_len=64); "
              "print(engine._process.pid); sys.stdout.flush()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    child = int(done.stdout.split()[-1])
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text()
