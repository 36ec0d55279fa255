"""Load and faults: 64 concurrent streaming clients, a third hanging up at random points; every
other stream must complete correctly and nothing may leak (KV blocks, running/waiting)."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest
import torch

from server_helpers import SERVED_NAME, ServerProcess, metric, request, scrape_metrics, stream_sse, wait_until

pytestmark = pytest.mark.integration

NUM_CLIENTS = 64
MAX_TOKENS = 48
CHAT_PATH = "/v1/chat/completions"
PROMPTS = ["Tell me about rivers.", "What is a weir?", "Count to ten.", "Write a haiku about dams."]


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    process = ServerProcess(tiny_llama_path, tmp_path_factory.mktemp("serve") / "serve.log")
    yield process
    assert process.stop() == 0, process.log()


def chat_body(client_index: int, stream: bool) -> dict:
    body = {"model": SERVED_NAME, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0,
            "seed": client_index, "messages": [{"role": "user", "content": PROMPTS[client_index % len(PROMPTS)]}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def no_leaks(port: int):
    samples = scrape_metrics(port)
    gauges = [metric(samples, f"weir:{name}") for name in
              ("num_requests_running", "num_requests_waiting", "num_requests_in_flight", "kv_cache_usage_perc")]
    return samples if gauges == [0, 0, 0, 0] else None


def run_load(server: ServerProcess) -> str:
    """64 streams, every third hanging up at a random point; checks them and the leak gauges and
    returns the figures as one line."""
    rng = random.Random(0)
    # Every third client hangs up: after 0 events (right after the headers) up to 12 of 48.
    hang_ups = {index: rng.randint(0, 12) for index in range(0, NUM_CLIENTS, 3)}
    before = scrape_metrics(server.port)

    async def load():
        streams = [stream_sse(server.port, CHAT_PATH, chat_body(index, stream=True),
                              hang_up_after=hang_ups.get(index)) for index in range(NUM_CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(*streams), timeout=120)

    start = time.perf_counter()
    results = asyncio.run(load())
    elapsed = time.perf_counter() - start
    after = wait_until(lambda: no_leaks(server.port), timeout=15)
    assert after is not None, f"leak after the load: {scrape_metrics(server.port)}"

    completed = {index: result for index, result in enumerate(results) if index not in hang_ups}
    assert all(result.disconnected for index, result in enumerate(results) if index in hang_ups)
    for index, result in completed.items():
        assert result.status == 200 and result.done, (index, result)
        reasons = [e["choices"][0]["finish_reason"] for e in result.events if e["choices"]]
        assert reasons.count("length") == 1 and reasons[-1] == "length"
        assert result.events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    # Each completed stream's text is what the same seeded request gives without streaming.
    for index, result in list(completed.items())[:8]:
        status, reference = request("POST", server.port, CHAT_PATH, chat_body(index, stream=False))
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in result.events if e["choices"])
        assert status == 200 and streamed == reference["choices"][0]["message"]["content"]

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    aborted = delta("weir:request_success_total", finished_reason="abort")
    assert 1 <= aborted <= len(hang_ups)
    assert delta("weir:request_success_total", finished_reason="length") + aborted == NUM_CLIENTS
    generated = delta("weir:generation_tokens_total")
    return (f"{NUM_CLIENTS} streams, {len(hang_ups)} hung up ({aborted:.0f} aborted in the engine), "
            f"{len(completed)} completed; {generated:.0f} tokens in {elapsed:.2f} s = "
            f"{generated / elapsed:.0f} tok/s; after: running/waiting/in-flight 0, KV usage 0")


def test_64_streams_with_a_third_hanging_up(server):
    print(f"\nload (cpu): {run_load(server)}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_64_streams_with_a_third_hanging_up_on_cuda(tiny_llama_path, tmp_path):
    # float32: the seeded stream-vs-reference comparison must not hinge on bf16 batch effects
    server = ServerProcess(tiny_llama_path, tmp_path / "serve.log", "--dtype", "float32", device="cuda")
    try:
        print(f"\nload (cuda): {run_load(server)}")
    finally:
        assert server.stop() == 0, server.log()


def test_non_streaming_client_that_hangs_up_is_aborted(server):
    before = scrape_metrics(server.port)
    body = (b'{"model": "tiny", "prompt": "abc", "max_tokens": 250, "ignore_eos": true}')
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.02)
    def answered_499():
        samples = no_leaks(server.port)  # the 499 is counted just after the abort: wait for both
        counted = samples and metric(samples, "weir:http_requests_total", endpoint="/v1/completions",
                                     status="499")
        return samples if counted else None

    after = wait_until(answered_499, timeout=15)
    assert after is not None, scrape_metrics(server.port)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("weir:request_success_total", finished_reason="abort") == 1
    assert delta("weir:http_requests_total", endpoint="/v1/completions", status="499") == 1
    assert delta("weir:generation_tokens_total") < 250
