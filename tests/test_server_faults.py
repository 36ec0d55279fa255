"""Faults inside the server: an engine step that raises, a handler that raises, a dead engine
loop, queued prompt tokens over the admission limit (engine paused, so it is exact), a prompt
that takes long to tokenize, a client gone in the middle of its upload."""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_helpers import metric, request, scrape_metrics, stream_sse, wait_until
from server_inprocess import serve_in_thread
from weir.server.settings import ServerSettings

pytestmark = pytest.mark.integration

COMPLETION = {"model": "tiny", "prompt": "abc", "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    with serve_in_thread(tiny_llama_path, ServerSettings(max_num_queued_tokens=200)) as served:
        yield served


def fail_on_call(monkeypatch, target, name: str, failing_call: int, error: BaseException) -> None:
    """Make ``target.name`` raise ``error`` on its ``failing_call``-th call (once)."""
    original = getattr(target, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == failing_call:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)


def test_engine_step_failure_fails_the_requests_in_it_and_serving_goes_on(served, monkeypatch):
    port, engine, _ = served
    fail_on_call(monkeypatch, engine.engine.runner, "execute", 3, RuntimeError("injected device fault"))
    status, body = request("POST", port, "/v1/completions", COMPLETION)
    assert status == 500 and body["error"]["code"] == "engine_error", body
    assert "injected device fault" in body["error"]["message"] and body["error"]["type"] == "server_error"

    fail_on_call(monkeypatch, engine.engine.runner, "execute", 3, RuntimeError("injected again"))
    result = asyncio.run(stream_sse(port, "/v1/completions", {**COMPLETION, "stream": True}))
    assert result.status == 200 and result.done
    assert result.events[-1]["error"]["code"] == "engine_error"
    monkeypatch.undo()

    status, body = request("POST", port, "/v1/completions", COMPLETION)
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    assert request("GET", port, "/health")[0] == 200
    samples = wait_until(lambda: (s := scrape_metrics(port)) and metric(s, "weir:num_requests_running") == 0
                         and metric(s, "weir:kv_cache_usage_perc") == 0 and s, timeout=10)
    assert samples, scrape_metrics(port)
    assert metric(samples, "weir:request_success_total", finished_reason="error") == 2


def test_a_failed_step_spares_the_requests_still_waiting(tiny_llama_path, monkeypatch):
    with serve_in_thread(tiny_llama_path, max_num_seqs=1) as (port, engine, _):
        scheduler = engine.engine.scheduler
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(request, "POST", port, "/v1/completions", {**COMPLETION, "max_tokens": 200})
            assert wait_until(lambda: scheduler.num_running == 1, timeout=10)
            waiting = pool.submit(request, "POST", port, "/v1/completions", {**COMPLETION, "prompt": "def"})
            assert wait_until(lambda: scheduler.num_waiting == 1, timeout=10)  # max_num_seqs=1
            fail_on_call(monkeypatch, engine.engine.runner, "execute", 1, RuntimeError("injected device fault"))
            status, body = running.result(60)
            assert status == 500 and "injected device fault" in body["error"]["message"]
            status, body = waiting.result(60)
            assert status == 200 and body["usage"]["completion_tokens"] == 12


def test_an_exception_in_a_handler_fails_that_request_only(served, monkeypatch):
    port, _, app = served
    fail_on_call(monkeypatch, app.state.weir, "render_chat", 1, KeyError("injected handler bug"))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, body = request("POST", port, "/v1/chat/completions", chat)
    assert status == 500 and body["error"]["code"] == "internal_error" and "injected handler bug" in str(body)
    status, body = request("POST", port, "/v1/chat/completions", chat)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


def test_queued_prompt_tokens_over_the_limit_get_503(served):
    port, engine, app = served
    admission = app.state.weir.admission
    gate = threading.Event()
    engine.call(lambda _: gate.wait(30))  # the engine thread waits: nothing gets prefilled
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(request, "POST", port, "/v1/completions", {**COMPLETION, "prompt": "x" * 150})
            assert wait_until(lambda: admission.num_waiting_tokens == 150, timeout=10)
            status, body = request("POST", port, "/v1/completions", {**COMPLETION, "prompt": "y" * 60})
            assert status == 503 and body["error"]["code"] == "server_overloaded"
            assert "--max-num-queued-tokens" in body["error"]["message"] and "150" in body["error"]["message"]
            # 150 + 50 fits the 200-token limit: admitted, it waits behind the gate
            small = pool.submit(request, "POST", port, "/v1/completions", {**COMPLETION, "prompt": "y" * 50})
            assert wait_until(lambda: admission.num_waiting_tokens == 200, timeout=10)
            gate.set()
            assert first.result(60)[0] == 200 and small.result(60)[0] == 200
    finally:
        gate.set()
    assert admission.num_waiting_tokens == 0 and admission.num_requests == 0


def test_a_prompt_longer_than_the_context_is_refused_before_it_counts_as_queued(served):
    """It used to be admitted (its tokens queued) until the engine refused it, and requests sent
    meanwhile got 503s for tokens that would never run."""
    port, engine, app = served
    admission = app.state.weir.admission
    num_rejected = admission.num_rejected
    gate = threading.Event()
    engine.call(lambda _: gate.wait(30))  # the engine thread waits: it cannot refuse anything
    try:
        with ThreadPoolExecutor(1) as pool:
            small = pool.submit(request, "POST", port, "/v1/completions", {**COMPLETION, "prompt": "y" * 150})
            assert wait_until(lambda: admission.num_waiting_tokens == 150, timeout=10)
            for prompt in ("x" * 300, [65] * 256):  # max_model_len is 256
                status, body = request("POST", port, "/v1/completions", {**COMPLETION, "prompt": prompt}, timeout=10)
                assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
                assert "max_model_len is 256" in body["error"]["message"] and body["error"]["param"] == "prompt"
                assert admission.num_waiting_tokens == 150 and admission.num_rejected == num_rejected
            gate.set()
            assert small.result(60)[0] == 200
    finally:
        gate.set()


def test_tokenizing_a_prompt_does_not_stop_the_event_loop(served, monkeypatch):
    """A prompt of megabytes took over 20 s to tokenize on the event loop, and nobody else was
    answered meanwhile: the tokenizer is held here until /health has answered."""
    import weir.server.state

    port, _, _ = served
    entered, release = threading.Event(), threading.Event()
    original = weir.server.state.encode_prompt

    def slow_encode(tokenizer, text):
        entered.set()
        release.wait(30)
        return original(tokenizer, text)

    monkeypatch.setattr(weir.server.state, "encode_prompt", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(request, "POST", port, "/v1/completions", COMPLETION)
        try:
            assert entered.wait(10)
            assert request("GET", port, "/health", timeout=10)[0] == 200
            assert request("POST", port, "/detokenize", {"tokens": [72, 105]}, timeout=10)[0] == 200
        finally:
            release.set()
        assert slow.result(60)[0] == 200


def test_a_client_gone_mid_upload_is_a_499_not_a_500(served):
    port, _, _ = served
    endpoint = "/v1/completions"
    before = scrape_metrics(port)
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: 1000\r\n\r\n{\"prompt\": \"ab")  # 1000 bytes promised
    counted = wait_until(lambda: metric(scrape_metrics(port), "weir:http_requests_total", endpoint=endpoint,
                                        status="499") > metric(before, "weir:http_requests_total",
                                                               endpoint=endpoint, status="499"), timeout=10)
    assert counted
    assert metric(scrape_metrics(port), "weir:http_requests_total", endpoint=endpoint, status="500") == \
        metric(before, "weir:http_requests_total", endpoint=endpoint, status="500")


class FatalLoopError(BaseException):
    """Not an Exception: the engine loop's own error handling cannot absorb it."""


def test_a_dead_engine_loop_answers_503_and_health_says_so(tiny_llama_path, monkeypatch):
    with serve_in_thread(tiny_llama_path) as (port, engine, _):
        fail_on_call(monkeypatch, engine.engine, "step", 1, FatalLoopError("injected loop death"))
        status, body = request("POST", port, "/v1/completions", COMPLETION)
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        assert wait_until(lambda: not engine.is_running, timeout=10)
        assert request("GET", port, "/health")[0] == 503
        status, body = request("POST", port, "/v1/completions", COMPLETION)
        assert status == 503 and "not running" in body["error"]["message"]
        assert request("GET", port, "/metrics")[0] == 200
