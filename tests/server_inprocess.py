"""``build_app`` served by uvicorn on a thread of the test process, so a test can reach into the
engine (inject faults, pause it) while real HTTP requests go through 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import torch
import uvicorn

from helpers_models import TINY_EOS_ID

from weir.async_engine import AsyncLLMEngine
from weir.engine import LLMEngine
from weir.server.app import build_app
from weir.server.connections import uvicorn_options
from weir.server.settings import ServerSettings


@contextlib.contextmanager
def serve_in_thread(model_path, settings: ServerSettings | None = None, **engine_options):
    """Yields ``(port, async_engine, app)``; the server and the engine stop on exit."""
    options = {"device": "cpu", "max_model_len": 256, "served_model_name": "tiny", **engine_options}
    engine = AsyncLLMEngine(LLMEngine.from_options(str(model_path), **options))
    settings = settings or ServerSettings()
    app = build_app(engine, settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                                           **uvicorn_options(settings)))
    # Off the main thread uvicorn installs no signal handlers.
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1], engine, app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# A chat template that shows what reaches it (tools, tool calls), and a Hermes tool call.
TEMPLATE = ("{% if tools %}TOOLS{{ tools | length }}|{% endif %}{% for m in messages %}<{{ m['role'] }}>"
            "{% if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}{{ m['content'] or '' }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedReply:
    """Makes the model write ``text`` (one byte per token with the tiny tokenizer), then EOS."""

    def __init__(self, engine):
        self.model = engine.runner.model
        self.original = self.model.compute_logits
        self.tokens: list[int] = []
        self.model.compute_logits = self.compute_logits

    def say(self, text: str) -> None:
        self.tokens = list(text.encode()) + [TINY_EOS_ID]

    def compute_logits(self, hidden):
        logits = self.original(hidden)
        forced = torch.full_like(logits, -1e4)
        forced[:, self.tokens.pop(0) if self.tokens else TINY_EOS_ID] = 1e4
        return forced


@contextlib.contextmanager
def scripted_tool_server(model_path):
    """A server with Hermes tool calls and qwen3 reasoning parsed, ``TEMPLATE`` as its chat
    template, one request at a time: yields ``(openai client, ScriptedReply)``."""
    import openai

    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    with serve_in_thread(model_path, settings, chat_template=TEMPLATE, max_num_seqs=1) as (port, engine, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, ScriptedReply(engine.engine)
