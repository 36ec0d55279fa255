"""A tiny fake OpenAI-compatible streaming server for ``weir bench serve`` tests.

Runs in-process (starlette + uvicorn on 127.0.0.1, a free port) in a background thread; it
streams one chunk per token, ends with a finish chunk and (optionally) a usage chunk, and records every
request body, its arrival time and the most streams it had open at once. Run as a script
(``python bench_fake_server.py MODEL --port P ...``, other options ignored) it stands in for a
peer server process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

FAKE_MODEL = "fake-model"
FAKE_VERSION = "0.0.fake"
TOKEN_DELAY_SECONDS = 0.004


@dataclass
class FakeServerState:
    bodies: list[dict] = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    fail_every: int = 0  # answer every fail_every-th request with HTTP 500 (0: never)
    send_usage: bool = True  # end each stream with a usage chunk, as vLLM does when asked

    def reset(self, fail_every: int = 0, send_usage: bool = True) -> None:
        self.bodies.clear()
        self.arrival_times.clear()
        self.in_flight = self.max_in_flight = 0
        self.fail_every = fail_every
        self.send_usage = send_usage


def _app(state: FakeServerState):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    async def health(request):
        return JSONResponse({})

    async def version(request):
        return JSONResponse({"version": FAKE_VERSION})

    async def generate(request):
        body = await request.json()
        state.bodies.append(body)
        state.arrival_times.append(time.perf_counter())
        if state.fail_every and len(state.bodies) % state.fail_every == 0:
            return JSONResponse({"error": {"message": "fake failure"}}, status_code=500)
        is_chat = request.url.path.endswith("/chat/completions")
        prompt = body.get("prompt") or body["messages"][0]["content"].split()
        num_tokens = body["max_tokens"]

        def chunk(text, finish_reason=None):
            if is_chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish_reason}
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            counted = True
            try:
                if is_chat:  # a role-only first delta, as real servers send: not a token
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield f"data: {json.dumps({'choices': [role]})}\n\n"
                for index in range(num_tokens):
                    await asyncio.sleep(TOKEN_DELAY_SECONDS)
                    yield chunk(f" t{index}")
                yield chunk("", "length")
                usage = {"prompt_tokens": len(prompt), "completion_tokens": num_tokens,
                         "total_tokens": len(prompt) + num_tokens}
                if state.send_usage:
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                # Leave the count before the client can see the end and send its next request.
                state.in_flight -= 1
                counted = False
                yield "data: [DONE]\n\n"
            finally:
                if counted:
                    state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/health", health),
        Route("/version", version),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
    ])


class FakeOpenAIServer:
    """``with FakeOpenAIServer() as server: server.base_url``; stops within a few seconds."""

    def __init__(self):
        self.state = FakeServerState()
        self._server = None
        self._thread = None
        self.base_url = ""

    def __enter__(self) -> "FakeOpenAIServer":
        import uvicorn

        config = uvicorn.Config(_app(self.state), host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake OpenAI server did not start within 10 s")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    options, _ = parser.parse_known_args()
    uvicorn.run(_app(FakeServerState()), host=options.host, port=options.port, log_level="warning")
