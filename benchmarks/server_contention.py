"""What serving costs the engine loop: host time per engine step with `weir serve`'s event loop
streaming to clients, against the same engine driven by `LLM.generate` alone.

    python3 -m benchmarks.server_contention [--streams 32] [--output-len 256] [--device-step-ms 9]

Run from the repo root, on the CPU: a tiny model (tests/helpers_models.py) keeps the forward
small, and a sleep before each step stands in for the device's share of it (it frees the GIL as
waiting on the GPU does). The server runs on a thread of this process, with the engine loop in
either place `weir serve` can put it: on a thread beside the event loop (`--engine-in-process`:
the two share one GIL) or in a process of its own (the default). The `weir bench serve` client
runs in its own process. The difference between a served host time and the one alone is what
the server takes from each step; the client's mean TPOT shows what a user sees of it.
"""

import argparse
import functools
import pathlib
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tests.helpers_models import make_tiny_llama
from weir import LLM, SamplingParams
from weir.async_engine import AsyncLLMEngine
from weir.engine import LLMEngine
from weir.multiproc import ProcessEngine
from weir.server.app import build_app
from weir.server.connections import uvicorn_options
from weir.server.settings import ServerSettings


def timed_steps(llm_engine, device_step: float) -> list[float]:
    """Wraps ``llm_engine.step``; the returned list (also ``llm_engine.host_seconds``) fills with
    each step's host seconds."""
    host, inner = [], llm_engine.step
    llm_engine.host_seconds = host

    def step():
        start = time.perf_counter()
        time.sleep(device_step)
        outputs = inner()
        host.append(time.perf_counter() - start - device_step)
        return outputs

    llm_engine.step = step
    return host


def trimmed_mean_ms(seconds: list[float]) -> float:
    cut = len(seconds) // 10  # the first steps (prefill) and the stragglers' last ones
    return statistics.mean(sorted(seconds)[cut:len(seconds) - cut]) * 1e3


def read_host_seconds(llm_engine) -> list[float]:
    return llm_engine.host_seconds


def served_host_times(path: pathlib.Path, options: dict, args, device_step: float,
                      engine_process: bool) -> tuple[list[float], float]:
    """(host seconds of each step, the client's mean TPOT in ms)."""
    import uvicorn

    options = {**options, "served_model_name": "tiny"}
    if engine_process:
        engine = ProcessEngine(str(path), options, on_start=functools.partial(timed_steps, device_step=device_step))
    else:
        engine = AsyncLLMEngine(LLMEngine.from_options(str(path), **options))
        timed_steps(engine.engine, device_step)
    settings = ServerSettings()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, settings), log_level="warning", lifespan="on",
                                           **uvicorn_options(settings)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        bench = subprocess.run(
            [sys.executable, "-m", "weir.cli.main", "bench", "serve", "--base-url",
             f"http://127.0.0.1:{sock.getsockname()[1]}", "--num-prompts", str(args.streams), "--request-rate", "inf",
             "--random-input-len", "32", "--random-output-len", str(args.output_len), "--ignore-eos", "--seed", "0",
             "--text"], capture_output=True, text=True, timeout=600)
        if "Failed requests                                              0" not in bench.stdout:
            raise SystemExit(f"the bench run failed:\n{bench.stdout[-2000:]}\n{bench.stderr[-2000:]}")
        host = engine.call(read_host_seconds).result(30)
    finally:
        server.should_exit = True
        thread.join(30)
    tpot = float(re.search(r"Mean TPOT \(ms\):?\s+([0-9.]+)", bench.stdout).group(1))
    return host, tpot


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=32, help="requests streamed at once")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--device-step-ms", type=float, default=9.0, help="the device's time per step, slept")
    args = parser.parse_args()
    path = make_tiny_llama(pathlib.Path(tempfile.mkdtemp()), with_tokenizer=True, num_hidden_layers=1,
                           hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    options = {"device": "cpu", "max_model_len": 512, "max_num_seqs": args.streams}
    device_step = args.device_step_ms / 1e3

    llm = LLM(str(path), **options)
    alone = timed_steps(llm.engine, device_step)
    rng = random.Random(0)
    llm.generate([{"prompt_token_ids": [rng.randrange(256) for _ in range(32)]} for _ in range(args.streams)],
                 SamplingParams(max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
    del llm
    alone_ms = trimmed_mean_ms(alone)
    print(f"{args.streams} streams: engine host time per step {alone_ms:.2f} ms alone")
    for engine_process, where in ((False, "engine on a thread of the server"), (True, "engine in its own process")):
        served, tpot = served_host_times(path, options, args, device_step, engine_process)
        served_ms = trimmed_mean_ms(served)
        print(f"  served, {where}: {served_ms:.2f} ms (+{served_ms - alone_ms:.2f} ms, "
              f"{(served_ms - alone_ms) * 1e3 / args.streams:.0f} us per stream); client mean TPOT {tpot:.2f} ms")


if __name__ == "__main__":
    main()
