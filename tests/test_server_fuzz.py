"""Fuzzing a running server: valid bodies of every endpoint, each mutated at random in one or more
of its fields (any depth) or in its raw bytes, with a fixed seed. Whatever comes in, the answer is
never a 5xx: a 4xx has OpenAI's error body, a 2xx is well-formed JSON (or SSE whose every event is
JSON, ending as the endpoint ends its streams), the connection stays open, and the server goes on
serving. A failure prints the body that caused it, to replay."""

from __future__ import annotations

import copy
import http.client
import json
import random

import pytest

from server_helpers import request
from server_inprocess import TEMPLATE, serve_in_thread
from weir.server.settings import ServerSettings

pytestmark = pytest.mark.integration  # a real server over HTTP

SEED = 20
NUM_REQUESTS = 4000
MAX_MODEL_LEN = 192
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3, "presence_penalty": 0.1,
            "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_tokens": 0, "stop": ["\n\n"],
            "stop_token_ids": [5], "ignore_eos": False, "skip_special_tokens": True,
            "include_stop_str_in_output": False, "user": "u1", "logit_bias": None}

# Valid bodies, together naming every field each endpoint reads.
SEEDS = {
    "/v1/chat/completions": [
        {"model": "tiny", "messages": [USER], "max_tokens": 2},
        {"model": "tiny", "messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
                                       {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                       {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}],
         "max_completion_tokens": 2, "n": 2, "logprobs": True, "top_logprobs": 2, "tools": [TOOL],
         "tool_choice": "auto", "parallel_tool_calls": False, "stream": True,
         "stream_options": {"include_usage": True}, **SAMPLING},
        {"model": "tiny", "messages": [USER, {"role": "assistant", "content": "Hel"}], "max_tokens": 2,
         "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1},
         "reasoning_effort": "low", "response_format": {"type": "text"}, "modalities": ["text"], "store": False,
         "metadata": {"k": "v"}, "service_tier": "auto", "echo": False, "functions": None, "function_call": "none",
         "audio": None, "prediction": None, "tool_choice": "none", "tools": [TOOL], "prompt_logprobs": None},
    ],
    "/v1/completions": [
        {"model": "tiny", "prompt": "hello", "max_tokens": 2},
        {"model": "tiny", "prompt": ["a", "bc"], "max_tokens": 2, "n": 2, "best_of": 2, "logprobs": 2, "echo": False,
         "stream": True, "stream_options": {"include_usage": True}, "suffix": None, **SAMPLING},
        {"model": "tiny", "prompt": [72, 105], "max_tokens": 1, "echo": True, "response_format": {"type": "text"}},
        {"prompt": [[72, 105], [65]], "max_tokens": 1, "logprobs": 0},
    ],
    "/v1/responses": [
        {"model": "tiny", "input": "hi", "max_output_tokens": 2},
        {"model": "tiny", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
                                    {"type": "reasoning", "summary": []},
                                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                                    {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
         "instructions": "be brief", "max_output_tokens": 2, "temperature": 0.5, "top_p": 0.9, "stream": True,
         "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
         "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"effort": "low"},
         "text": {"format": {"type": "text"}}, "store": False, "metadata": {"k": "v"}, "user": "u",
         "truncation": "disabled", "include": None, "previous_response_id": None, "conversation": None,
         "background": False, "top_logprobs": None, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.0,
         "chat_template_kwargs": {"x": 1}},
    ],
    "/tokenize": [
        {"model": "tiny", "prompt": "hello", "add_special_tokens": False},
        {"model": "tiny", "messages": [USER, {"role": "assistant", "content": "x"}], "add_generation_prompt": False,
         "continue_final_message": True, "chat_template_kwargs": {"x": 1}, "reasoning_effort": "low",
         "tools": [TOOL]},
    ],
    "/detokenize": [{"model": "tiny", "tokens": [72, 105, 33]}],
}

# Values at the edges of what fields take: sizes (n's 128, the context, the tiny vocabulary's 320
# ids, int64), floats at the edges of a double, control and format characters, template syntax.
INTERESTING = [None, True, False, 0, 1, -1, 2, 7, 20, 21, 127, 128, 129, 255, 256, 319, 320, 4096, 2**31, 2**63,
               -(2**63) - 1, 2**64, 10**30, 0.0, -0.0, 1e-9, 0.5, 1.5, -2.5, 100.0, 1e308, 5e-324, "", " ", "a", "auto",
               "none", "required", "text", "user", "assistant", "function", "tiny", "\ud800", "\udfff", "a\x00b",
               "🎉 café", "\u202e", "\ufffd", "x" * 5000, "{{ 1 }}", "{% raw %}", "</s>", "<tool_call>", "{}",
               [], [1], [-1], [320], [2**31], ["a"], [""], [None], [[]], [[1, 2]], [{}], [{"type": "text", "text": "x"}],
               [{"type": "input_text", "text": "x"}], [USER], [TOOL], ["a"] * 300, list(range(300)), {}, {"a": 1},
               {"type": "text"}, {"type": "json_object"}, {"type": "function"}, {"type": "function", "name": "f"},
               {"effort": "high"}, {"format": {"type": "text"}}, {"include_usage": True}, {"\ud800": 1}]
RAW_LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999", b"9" * 4400, b"\"\\ud800\"",
                b"\"\xed\xa0\x80\"", b"\"\xff\xfe\"", b"\"\xc3\"", b"[" * 2000 + b"]" * 2000, b"{}", b"nul", b"\"\\x\""]
UNKNOWN_FIELDS = ["foo", "prompt_logprobs", "guided_json", "truncate_prompt_tokens", "logits_processors",
                  "structured_outputs", "bad_words", "allowed_token_ids", "vllm_xargs", "documents"]


def paths(value, prefix=()):
    """Every (path, value) inside a JSON value, itself included."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def random_value(rng: random.Random, old):
    kind = rng.random()
    if kind < 0.55:
        return copy.deepcopy(rng.choice(INTERESTING))
    if kind < 0.65 and isinstance(old, (int, float)) and not isinstance(old, bool):
        return rng.choice([old * 10**rng.randrange(1, 40), -old, old + 0.5, str(old)])
    if kind < 0.75 and isinstance(old, str):
        cut = rng.randrange(len(old) + 1)
        return old[:cut] + rng.choice(["\ud800", "\x00", "{{", "}}", "{% for %}", "<tool_call>", "\n\n", "é"]) + old[cut:]
    if kind < 0.85:
        return [copy.deepcopy(old)] * rng.choice([1, 2, 3])
    return {"nested": copy.deepcopy(old)}


def mutate_fields(rng: random.Random, body: dict) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        path, old = rng.choice(list(paths(body)))
        if not path:
            body[rng.choice(UNKNOWN_FIELDS)] = random_value(rng, None)
            continue
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = rng.random()
        if action < 0.15:
            del parent[path[-1]]
        elif action < 0.25 and isinstance(parent, list):
            parent.insert(path[-1], copy.deepcopy(old))
        else:
            parent[path[-1]] = random_value(rng, old)
    return body


def mutate_raw(rng: random.Random, body: dict) -> bytes:
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
    action = rng.random()
    if action < 0.5:  # a value's literal replaced by one JSON parsers disagree about
        colons = [index for index, byte in enumerate(raw) if byte == ord(":")]
        at = rng.choice(colons) + 1
        end = at
        while end < len(raw) and raw[end] not in b",}]":
            end += 1
        return raw[:at] + rng.choice(RAW_LITERALS) + raw[end:]
    if action < 0.7:
        return raw[:rng.randrange(len(raw))]
    if action < 0.85:
        at = rng.randrange(len(raw))
        return raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:]
    at = rng.randrange(len(raw))
    return raw[:at] + rng.choice([b"\xed\xa0\x80", b"\xff", b"\xc3", b"\x00", b"\\"]) + raw[at:]


def strict_json(data: bytes):
    """JSON as RFC 8259 has it: UTF-8, no NaN or Infinity."""
    def refuse(name):
        raise ValueError(f"{name} in a response")
    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def check_error_body(status: int, data: bytes) -> None:
    body = strict_json(data)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] == "invalid_request_error", body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


def check_stream(path: str, data: bytes) -> None:
    text = data.decode("utf-8")
    assert text.endswith("\n\n"), text[-200:]
    events = [event for event in text.split("\n\n") if event]
    payloads = []
    for event in events:
        lines = event.split("\n")
        data_lines = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert len(data_lines) == 1 and all(line.startswith(("data: ", "event: ")) for line in lines), event
        payloads.append(data_lines[0])
    if path == "/v1/responses":
        parsed = [strict_json(payload.encode()) for payload in payloads]
        assert parsed[0]["type"] == "response.created", parsed[0]
        assert parsed[-1]["type"] in ("response.completed", "response.incomplete"), parsed[-1]
        assert [event["sequence_number"] for event in parsed] == list(range(len(parsed)))
    else:
        assert payloads[-1] == "[DONE]", payloads[-1]
        parsed = [strict_json(payload.encode()) for payload in payloads[:-1]]
    errors = [event for event in parsed if "error" in event or event.get("type") == "error"]
    assert not errors, errors  # an error event is a failure the request's checks should have caught


OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
           "/v1/responses": "response"}


def check_success(path: str, content_type: str, data: bytes) -> None:
    if content_type.startswith("text/event-stream"):
        check_stream(path, data)
        return
    body = strict_json(data)
    if path in OBJECTS:
        assert body["object"] == OBJECTS[path], body
    elif path == "/tokenize":
        assert body["count"] == len(body["tokens"]) and all(isinstance(t, int) for t in body["tokens"]), body
    else:
        assert isinstance(body["prompt"], str), body


def fuzz_cases(rng: random.Random, count: int):
    endpoints = sorted(SEEDS)
    for _ in range(count):
        path = rng.choice(endpoints)
        seed = rng.choice(SEEDS[path])
        if rng.random() < 0.8:
            yield path, json.dumps(mutate_fields(rng, seed)).encode()
        else:
            yield path, mutate_raw(rng, seed)


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    with serve_in_thread(tiny_llama_path, settings, chat_template=TEMPLATE, max_model_len=MAX_MODEL_LEN) as served:
        yield served


def test_seed_bodies_are_valid(served):
    """The mutations start from bodies the server serves (or the fuzzing tests little)."""
    port, _, _ = served
    for path, bodies in SEEDS.items():
        for body in bodies:
            status, answer = request("POST", port, path, body)
            assert status == 200, (path, body, answer)


def test_mutated_bodies_get_4xx_or_well_formed_2xx_and_never_5xx(served):
    port, _, app = served
    rng = random.Random(SEED)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    statuses: dict[int, int] = {}
    try:
        for number, (path, raw) in enumerate(fuzz_cases(rng, NUM_REQUESTS)):
            connection.request("POST", path, body=raw, headers={"content-type": "application/json"})
            sock = connection.sock
            response = connection.getresponse()
            data = response.read()
            case = f"request {number}: POST {path} {raw[:600]!r} -> {response.status} {data[:600]!r}"
            statuses[response.status] = statuses.get(response.status, 0) + 1
            assert response.status < 500, case
            try:
                if response.status >= 400:
                    check_error_body(response.status, data)
                else:
                    check_success(path, response.getheader("content-type", ""), data)
            except (AssertionError, ValueError, KeyError, TypeError) as error:
                raise AssertionError(f"{case}: {error!r}") from error
            assert not response.will_close, f"{case}: the server closed the connection"
            assert connection.sock is sock, case
    finally:
        connection.close()
    # Both kinds of answer are exercised, and the server is as it was.
    assert statuses.get(200, 0) > NUM_REQUESTS // 10 and sum(n for s, n in statuses.items() if s >= 400) > NUM_REQUESTS // 3
    admission = app.state.weir.admission
    assert (admission.num_requests, admission.num_waiting_tokens) == (0, 0)
    assert request("GET", port, "/health")[0] == 200
    status, body = request("POST", port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
