"""The client side of ``weir bench serve``: build requests, stream them, time every token.

Works against any OpenAI-compatible server. Streams are read as server-sent events; a chunk that
carries a choice counts as one token arrival (servers send one chunk per token, possibly with
empty text while a multi-byte character is incomplete), except a chat stream's opening role
announcement and a closing chunk that carries only a finish reason. Token counts come from the
stream's ``usage`` when the server sends it; without it they are the number of arrivals, an
estimate (a server may put several tokens in one chunk), and the summary says so.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

# Common English words: most are one token in BPE vocabularies, so a text prompt of N words is
# close to N tokens (the server's usage reports the exact count).
_WORDS = ("the of and to in is was for on that with as by at from his her they have this are which "
          "one you had not but what all were when we there can an your their said if do will each "
          "about how up out them then she many some so these would other into has more two time "
          "like could see him number way people my than first water been call who oil its now find "
          "long down day did get come made may part over new sound take only little work know place "
          "year live me back give most very after thing our just name good sentence man think say").split()


# (client, the transport it needs): httpx2 imports its transport only when a client is built, so
# an install without httpcore2 (or its truststore) imports fine and fails on the first request.
_HTTP_CLIENTS = (("httpx2", "httpcore2"), ("httpx", "httpcore"))


def http_module() -> Any:
    """The httpx API: ``httpx2`` (what huggingface_hub installs) or ``httpx``, the first whose
    import and transport import both work."""
    failures = []
    for name, transport in _HTTP_CLIENTS:
        try:
            module = importlib.import_module(name)
            importlib.import_module(transport)
        except Exception as error:  # noqa: BLE001 - a broken install fails in any way; try the next
            failures.append(f"{name}: {type(error).__name__}: {error}")
            continue
        return module
    raise RuntimeError("weir bench serve needs an HTTP client: pip install httpx (" + "; ".join(failures) + ")")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first token
    e2e: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between successive token arrivals
    output_tokens_estimated: bool = False  # no usage in the stream: output_tokens counts chunks


@dataclass(frozen=True)
class Workload:
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    model: str
    input_len: int
    output_len: int
    ignore_eos: bool
    temperature: float
    token_id_prompts: bool  # completions only: send prompt token ids, not text

    @property
    def is_chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")


def build_payloads(workload: Workload, num_prompts: int, seed: int) -> list[tuple[dict, int]]:
    """``(request body, prompt tokens as sent or estimated)`` per request, reproducible from ``seed``."""
    rng = random.Random(seed)
    payloads = []
    for _ in range(num_prompts):
        body: dict[str, Any] = {
            "model": workload.model, "max_tokens": workload.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": workload.temperature,
            "ignore_eos": workload.ignore_eos,
        }
        if workload.token_id_prompts and not workload.is_chat:
            body["prompt"] = [rng.randrange(10000) for _ in range(workload.input_len)]
        else:
            text = " ".join(rng.choice(_WORDS) for _ in range(workload.input_len))
            if workload.is_chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
        payloads.append((body, workload.input_len))
    return payloads


def _token_text(choice: dict, is_chat: bool) -> str | None:
    """The chunk's text, or None when the chunk carries no token."""
    if is_chat:
        delta = choice.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        if "role" in delta and not text:
            return None  # the role announcement that opens the stream, before any token
        if "content" not in delta and "reasoning_content" not in delta:
            return None  # a closing chunk: a finish reason only
    else:
        text = choice.get("text") or ""
    if not text and choice.get("finish_reason"):
        return None
    return text


async def _events(response: Any) -> AsyncIterator[dict]:
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(client: Any, url: str, body: dict, prompt_tokens: int, is_chat: bool) -> RequestResult:
    result = RequestResult(prompt_tokens=prompt_tokens)
    start = last_arrival = time.perf_counter()
    arrivals = 0
    usage_output_tokens = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for event in _events(response):
                if "error" in event:
                    result.error = f"server error in stream: {event['error']}"
                    return result
                usage = event.get("usage")
                if usage:
                    usage_output_tokens = usage.get("completion_tokens", usage_output_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
                choices = event.get("choices") or []
                if not choices or _token_text(choices[0], is_chat) is None:
                    continue
                now = time.perf_counter()
                if arrivals == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last_arrival)
                last_arrival = now
                arrivals += 1
        result.e2e = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - any transport failure is one failed request
        result.error = f"{type(error).__name__}: {error}"
        return result
    if arrivals == 0:
        result.error = "the stream ended without a token"
        return result
    result.output_tokens = usage_output_tokens if usage_output_tokens is not None else arrivals
    result.output_tokens_estimated = usage_output_tokens is None
    result.success = True
    return result


async def run_requests(base_url: str, workload: Workload, payloads: list[tuple[dict, int]],
                       request_rate: float, max_concurrency: int | None, seed: int,
                       timeout_seconds: float, progress: Any) -> tuple[list[RequestResult], float]:
    """Send every payload (Poisson arrivals at ``request_rate``/s, or all at once for inf), at most
    ``max_concurrency`` in flight; returns the results in payload order and the wall time."""
    httpx = http_module()
    url = base_url.rstrip("/") + workload.endpoint
    arrival_rng = random.Random(seed + 1)  # independent of the prompts: changing the rate keeps them
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_seconds), limits=limits) as client:
        async def one(body: dict, prompt_tokens: int) -> RequestResult:
            if limit is None:
                result = await send_request(client, url, body, prompt_tokens, workload.is_chat)
            else:
                async with limit:
                    result = await send_request(client, url, body, prompt_tokens, workload.is_chat)
            progress()
            return result

        start = time.perf_counter()
        tasks = []
        for index, (body, prompt_tokens) in enumerate(payloads):
            if index and request_rate != float("inf"):
                await asyncio.sleep(arrival_rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(body, prompt_tokens)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def first_model_name(base_url: str, timeout_seconds: float) -> str:
    """The first model the server lists at /v1/models."""
    httpx = http_module()
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_seconds)) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
