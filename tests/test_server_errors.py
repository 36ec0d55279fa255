"""Bad requests, API keys, body limits, admission control and /metrics on a real server."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time

import pytest

from server_helpers import SERVED_NAME, ServerProcess, metric, request, scrape_metrics, stream_sse, wait_until

pytestmark = pytest.mark.integration

API_KEY = "s3cret"
AUTH = {"authorization": f"Bearer {API_KEY}"}
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BODY_LIMIT = 65536
HEADER_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS = 2, 1, 40


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    # The key comes from the environment, as WEIR_API_KEY documents.
    process = ServerProcess(tiny_llama_path, tmp_path_factory.mktemp("serve") / "serve.log",
                            "--max-num-queued-reqs", "4", "--max-request-body-bytes", str(BODY_LIMIT),
                            "--timeout-header", str(HEADER_TIMEOUT), "--timeout-keep-alive", str(KEEP_ALIVE),
                            "--max-connections", str(MAX_CONNECTIONS), "--h11-max-incomplete-event-size", "8192",
                            env={"WEIR_API_KEY": API_KEY})
    yield process
    assert process.stop() == 0, process.log()


def chat(**fields):
    return {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields):
    return {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 4, **fields}


RESPONSES_PATH = "/v1/responses"


def response(**fields):
    return {"model": SERVED_NAME, "input": "hi", "max_output_tokens": 4, **fields}


SURROGATE_MODEL_BODIES = [
    (CHAT_PATH, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'),
    (COMPLETIONS_PATH, b'{"model": "\\ud800", "prompt": "hi"}'),
    (RESPONSES_PATH, b'{"model": "\\ud800", "input": "hi"}'),
    ("/tokenize", b'{"model": "\\ud800", "prompt": "hi"}'),
    ("/detokenize", b'{"model": "\\ud800", "tokens": [72]}'),
]
# Fields /v1/responses echoes in its response object.
RESPONSES_SURROGATES = [
    ("user", {"user": "\udc00"}, "user"),
    ("metadata-value", {"metadata": {"k": "v\ud800"}}, "metadata.k"),
    ("reasoning-effort", {"reasoning": {"effort": "\ud800"}}, "reasoning.effort"),
    ("instructions", {"instructions": "\ud800"}, "instructions"),
]
NOT_JSON_NUMBERS = [
    ("nan-in-reasoning", b'{"input": "hi", "reasoning": {"x": NaN}}', "NaN is not a JSON number"),
    ("infinity-in-tool-parameters", b'{"input": "hi", "tool_choice": "none", "tools": [{"type": "function", '
                                    b'"name": "f", "parameters": {"maximum": Infinity}}]}', "Infinity"),
    ("minus-infinity", b'{"input": "hi", "temperature": -Infinity}', "-Infinity is not a JSON number"),
    ("overflowing-float", b'{"input": "hi", "reasoning": {"x": 1e400}}', "1e400 is too large"),
]

# (id, path, body, headers, status, param, words the message must contain)
BAD_REQUESTS = [
    ("malformed-json", CHAT_PATH, b'{"model": ', AUTH, 400, None, "not valid JSON"),
    ("not-an-object", CHAT_PATH, b"[1, 2]", AUTH, 400, None, "JSON object"),
    ("empty-body", CHAT_PATH, b"", AUTH, 400, None, "empty"),
    ("missing-messages", CHAT_PATH, {"model": SERVED_NAME}, AUTH, 400, "messages", "required"),
    ("messages-wrong-type", CHAT_PATH, chat(messages="hi"), AUTH, 400, "messages", "messages"),
    ("unknown-role", CHAT_PATH, chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400,
     "messages.0.role", "role"),
    ("image-part", CHAT_PATH, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), AUTH, 400,
     "messages.0.content.0.type", "image_url"),
    ("temperature-string", CHAT_PATH, chat(temperature="hot"), AUTH, 400, "temperature", "number"),
    ("temperature-negative", CHAT_PATH, chat(temperature=-1), AUTH, 400, "temperature", ">= 0"),
    ("top-p-range", CHAT_PATH, chat(top_p=1.5), AUTH, 400, "top_p", "(0, 1]"),
    ("n-zero", CHAT_PATH, chat(n=0), AUTH, 400, "n", "n must be >= 1"),
    ("n-over-openai-limit", COMPLETIONS_PATH, completion(n=100_000), AUTH, 400, "n", "n must be <= 128"),
    ("max-completion-tokens-zero", CHAT_PATH, chat(max_completion_tokens=0), AUTH, 400, "max_completion_tokens",
     "max_completion_tokens must be >= 1"),
    # json.dumps escapes the lone surrogate as \ud800: valid JSON, but no text (UTF-8 cannot carry it).
    ("lone-surrogate-prompt", COMPLETIONS_PATH, completion(prompt="\ud800abc"), AUTH, 400, "prompt",
     "lone UTF-16 surrogate (U+D800)"),
    ("lone-surrogate-tokenize", "/tokenize", {"prompt": "\ud800abc"}, AUTH, 400, "prompt", "lone UTF-16 surrogate"),
    *[(f"lone-surrogate-model-{path}", path, body, AUTH, 400, "model", "lone UTF-16 surrogate (U+D800)")
      for path, body in SURROGATE_MODEL_BODIES],
    # The raw UTF-8 form of a surrogate, which Python's JSON parser reads as one.
    ("raw-surrogate-bytes-model", COMPLETIONS_PATH, b'{"model": "\xed\xa0\x80", "prompt": "hi"}', AUTH, 400,
     "model", "lone UTF-16 surrogate (U+D800)"),
    # json.loads of bytes would read UTF-16 and UTF-32 too, where the surrogate search is blind.
    *[(f"{encoding}-body", RESPONSES_PATH, json.dumps(response(user="\ud800")).encode(encoding, "surrogatepass"),
       AUTH, 400, None, "not valid JSON") for encoding in ("utf-16", "utf-16-le", "utf-32")],
    ("lone-surrogate-message", CHAT_PATH, chat(messages=[{"role": "user", "content": "a\udfffb"}]), AUTH, 400,
     "messages.0.content", "U+DFFF"),
    ("lone-surrogate-stop", CHAT_PATH, chat(stop=["ok", "\udc00"]), AUTH, 400, "stop.1", "surrogate"),
    ("lone-surrogate-key", CHAT_PATH, chat(metadata={"\ud800": "x"}), AUTH, 400, "metadata", "a key of 'metadata'"),
    ("surrogate-pair-is-text", "/tokenize", b'{"prompt": "\\ud83d\\ude00", "model": "\\ud800"}', AUTH, 400,
     "model", "U+D800"),  # the pair (an emoji) passes; the lone one after it does not
    *[(f"responses-{name}", RESPONSES_PATH, response(**fields), AUTH, 400, param, "lone UTF-16 surrogate")
      for name, fields, param in RESPONSES_SURROGATES],
    *[(f"responses-{name}-streamed", RESPONSES_PATH, response(stream=True, **fields), AUTH, 400, param,
       "lone UTF-16 surrogate") for name, fields, param in RESPONSES_SURROGATES],
    # NaN and Infinity are not JSON numbers (Python's parser takes them), nor is 1e400 a double.
    *[(f"not-a-json-number-{name}", RESPONSES_PATH, body, AUTH, 400, None, words)
      for name, body, words in NOT_JSON_NUMBERS],
    ("integer-over-4300-digits", COMPLETIONS_PATH, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", AUTH,
     400, None, "more than 4300 digits"),
    ("integer-over-4300-digits-nested", CHAT_PATH,
     b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": [' + b"1" * 4301 + b"]}}", AUTH, 400,
     None, "more than 4300 digits"),
    ("json-nested-too-deep", COMPLETIONS_PATH, b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}", AUTH, 400,
     None, "too deeply"),
    ("max-tokens-zero", CHAT_PATH, chat(max_tokens=0), AUTH, 400, "max_tokens", "max_tokens"),
    ("max-tokens-string", CHAT_PATH, chat(max_tokens="10"), AUTH, 400, "max_tokens", "integer"),
    ("seed-float", CHAT_PATH, chat(seed=1.5), AUTH, 400, "seed", "integer"),
    ("stream-not-bool", CHAT_PATH, chat(stream="yes"), AUTH, 400, "stream", "boolean"),
    ("stream-options-without-stream", CHAT_PATH, chat(stream_options={"include_usage": True}), AUTH, 400,
     "stream_options", "stream"),
    ("top-logprobs-too-many", CHAT_PATH, chat(logprobs=True, top_logprobs=30), AUTH, 400, "top_logprobs", "20"),
    ("top-logprobs-without-logprobs", CHAT_PATH, chat(top_logprobs=2), AUTH, 400, "top_logprobs", "logprobs"),
    ("tools", CHAT_PATH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), AUTH, 400, "tools",
     "--tool-call-parser"),
    ("tool-choice-required", CHAT_PATH, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                             tool_choice="required"), AUTH, 400, "tool_choice", "guided decoding"),
    ("tool-not-a-function", CHAT_PATH, chat(tools=[{"type": "retrieval"}], tool_choice="none"), AUTH, 400, "tools",
     "function"),
    ("logit-bias", CHAT_PATH, chat(logit_bias={"5": 1.0}), AUTH, 400, "logit_bias", "not supported"),
    ("response-format-json", CHAT_PATH, chat(response_format={"type": "json_object"}), AUTH, 400,
     "response_format", "not supported"),
    ("stop-token-ids-strings", CHAT_PATH, chat(stop_token_ids=["a"]), AUTH, 400, "stop_token_ids.0", "integer"),
    ("prompt-too-long", COMPLETIONS_PATH, completion(prompt="x" * 300), AUTH, 400, "prompt", "300"),
    ("empty-prompt", COMPLETIONS_PATH, completion(prompt=""), AUTH, 400, "prompt", "empty"),
    ("token-id-outside-vocab", COMPLETIONS_PATH, completion(prompt=[1, 999]), AUTH, 400, "prompt", "999"),
    ("completion-logprobs-over-max", COMPLETIONS_PATH, completion(logprobs=30), AUTH, 400, "logprobs",
     "max_logprobs"),
    ("echo-with-logprobs", COMPLETIONS_PATH, completion(echo=True, logprobs=1), AUTH, 400, "echo", "echo"),
    ("suffix", COMPLETIONS_PATH, completion(suffix="end"), AUTH, 400, "suffix", "not supported"),
    # vLLM extensions Weir does not have: refused, not answered as if honoured.
    ("guided-choice", CHAT_PATH, chat(guided_choice=["a", "b"]), AUTH, 400, "guided_choice", "not supported"),
    ("prompt-logprobs", COMPLETIONS_PATH, completion(prompt_logprobs=0), AUTH, 400, "prompt_logprobs",
     "not supported"),
    ("allowed-token-ids", COMPLETIONS_PATH, completion(allowed_token_ids=[1]), AUTH, 400, "allowed_token_ids",
     "not supported"),
    ("completion-response-format", COMPLETIONS_PATH, completion(response_format={"type": "json_object"}), AUTH,
     400, "response_format", "not supported"),
    ("continuous-usage-stats", CHAT_PATH,
     chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}), AUTH, 400,
     "stream_options.continuous_usage_stats", "not supported"),
    ("chat-echo", CHAT_PATH, chat(echo=True), AUTH, 400, "echo", "not supported"),
    ("template-kwargs-reserved", CHAT_PATH, chat(chat_template_kwargs={"add_generation_prompt": False}), AUTH, 400,
     "chat_template_kwargs", "add_generation_prompt"),
    ("continue-final-message-with-generation-prompt", CHAT_PATH,
     chat(messages=[{"role": "assistant", "content": "x"}], continue_final_message=True), AUTH, 400,
     "continue_final_message", "add_generation_prompt"),
    ("continue-final-message-after-user", CHAT_PATH,
     chat(continue_final_message=True, add_generation_prompt=False), AUTH, 400, "continue_final_message",
     "assistant"),
    ("max-tokens-past-context", COMPLETIONS_PATH, completion(max_tokens=255), AUTH, 400, "max_tokens",
     "maximum context length is 256"),
    ("unknown-model", CHAT_PATH, chat(model="gpt-9"), AUTH, 404, "model", "gpt-9"),
    ("no-api-key", CHAT_PATH, chat(), {}, 401, None, "API key"),
    ("wrong-api-key", CHAT_PATH, chat(), {"authorization": "Bearer nope"}, 401, None, "API key"),
    ("no-such-endpoint", "/v1/embeddings", chat(), AUTH, 404, None, "/v1/embeddings"),
    ("body-too-large", CHAT_PATH, chat(messages=[{"role": "user", "content": "x" * 100000}]), AUTH, 413, None,
     str(BODY_LIMIT)),
]


def assert_openai_error(body, status: int, param: str | None, words: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["param"] == param, error
    assert words in error["message"], error


@pytest.mark.parametrize("name,path,body,headers,status,param,words", BAD_REQUESTS,
                         ids=[row[0] for row in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server, name, path, body, headers, status, param, words):
    got_status, got_body = request("POST", server.port, path, body, headers)
    assert got_status == status, got_body
    assert_openai_error(got_body, status, param, words)


def test_prompt_too_long_names_both_lengths(server):
    status, body = request("POST", server.port, COMPLETIONS_PATH, completion(prompt="x" * 300), AUTH)
    assert status == 400 and "300" in body["error"]["message"] and "256" in body["error"]["message"]
    assert body["error"]["code"] == "context_length_exceeded"


def test_wrong_method_and_chunked_body_over_the_limit(server):
    status, body = request("GET", server.port, CHAT_PATH, None, AUTH)
    assert status == 405 and "GET" in body["error"]["message"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b"x" * 8192 for _ in range(12))  # no content-length: the limit applies while reading
    connection.request("POST", CHAT_PATH, body=chunks, headers={**AUTH, "content-type": "application/json"},
                       encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and b"request_too_large" in response.read()
    connection.close()


def test_good_request_after_the_bad_ones_succeeds(server):
    status, body = request("POST", server.port, CHAT_PATH, chat(max_tokens=3, ignore_eos=True), AUTH)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert request("GET", server.port, "/health")[0] == 200  # open without the key
    assert request("GET", server.port, "/v1/models", None, AUTH)[0] == 200


def test_admission_burst_gets_503s_and_the_rest_complete(server):
    body = completion(max_tokens=64, ignore_eos=True, stream=True, stream_options={"include_usage": True})

    async def burst():
        return await asyncio.gather(*(stream_sse(server.port, COMPLETIONS_PATH, {**body, "user": str(index)},
                                                 headers=AUTH) for index in range(12)))

    results = asyncio.run(burst())
    rejected = [r for r in results if r.status == 503]
    served = [r for r in results if r.status == 200]
    assert len(rejected) + len(served) == 12 and len(rejected) >= 1 and len(served) >= 4
    for result in rejected:
        assert_openai_error(result.error_body, 503, None, "--max-num-queued-reqs")
        assert result.error_body["error"]["code"] == "server_overloaded"
    for result in served:
        reasons = [e["choices"][0]["finish_reason"] for e in result.events if e["choices"]]
        assert result.done and reasons[-1] == "length" and result.events[-1]["usage"]["completion_tokens"] == 64


def test_metrics_counters_match_the_traffic(server):
    before = scrape_metrics(server.port)
    usages = []
    for max_tokens in (5, 6, 7):
        status, body = request("POST", server.port, CHAT_PATH, chat(max_tokens=max_tokens, ignore_eos=True), AUTH)
        assert status == 200
        usages.append(body["usage"])
    streamed = asyncio.run(stream_sse(server.port, COMPLETIONS_PATH,
                                      completion(max_tokens=4, ignore_eos=True, stream=True,
                                                 stream_options={"include_usage": True}), headers=AUTH))
    usages.append(streamed.events[-1]["usage"])
    assert request("POST", server.port, CHAT_PATH, chat(temperature=-1), AUTH)[0] == 400
    assert request("POST", server.port, COMPLETIONS_PATH, completion(n=0), AUTH)[0] == 400
    assert request("POST", server.port, CHAT_PATH, chat(model="nope"), AUTH)[0] == 404
    after = scrape_metrics(server.port)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    http_total = "weir:http_requests_total"
    assert delta(http_total, endpoint=CHAT_PATH, status="200") == 3
    assert delta(http_total, endpoint=COMPLETIONS_PATH, status="200") == 1
    assert delta(http_total, endpoint=CHAT_PATH, status="400") == 1
    assert delta(http_total, endpoint=COMPLETIONS_PATH, status="400") == 1
    assert delta(http_total, endpoint=CHAT_PATH, status="404") == 1
    assert delta("weir:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("weir:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 22
    assert delta("weir:request_success_total", finished_reason="length") == 4
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds"):
        assert delta(f"weir:{histogram}_count") == 4
        assert delta(f"weir:{histogram}_sum") > 0
    assert metric(after, "weir:num_requests_running") == metric(after, "weir:num_requests_waiting") == 0
    assert metric(after, "weir:kv_cache_usage_perc") == 0
    assert metric(after, "weir:prefix_cache_hits_total") > 0  # the three chats share their prompt


def test_bad_requests_keep_the_connection_alive(server):
    """A 500 from starlette's own error handler closed the connection; a 4xx keeps it."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    bad = [row for row in BAD_REQUESTS if row[0].startswith(("lone-surrogate", "raw-surrogate", "responses-",
                                                             "not-a-json-number", "integer-over"))]
    try:
        for name, path, body, headers, status, param, words in bad:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            connection.request("POST", path, body=payload, headers={**headers, "content-type": "application/json"})
            socket_before = connection.sock
            response = connection.getresponse()
            assert response.status == status, (name, response.read())
            assert_openai_error(json.loads(response.read()), status, param, words)
            assert response.getheader("connection") != "close", name
            connection.request("POST", COMPLETIONS_PATH, body=json.dumps(completion()).encode(),
                               headers={**AUTH, "content-type": "application/json"})
            assert connection.sock is socket_before, f"{name}: the server closed the connection"
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["object"] == "text_completion", name
    finally:
        connection.close()


def read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def read_response(sock: socket.socket, timeout: float) -> tuple[bytes, bytes]:
    """One HTTP response's head and body, however the server's writes were split into segments."""
    sock.settimeout(timeout)
    data = b""
    while True:
        head, found, body = data.partition(b"\r\n\r\n")
        if found:
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if length and len(body) >= int(length.group(1)):
                return head, body
        chunk = sock.recv(65536)
        if not chunk:
            return head, body
        data += chunk


def http_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def test_clients_sending_headers_a_byte_at_a_time_get_408_and_the_rest_are_served(server):
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(16)]
    silent = socket.create_connection(("127.0.0.1", server.port))  # connects and sends nothing
    started = time.monotonic()
    try:
        for byte in b"POST /v1/completions HTTP/1.1\r\nhost:":
            for sock in slow:
                sock.sendall(bytes([byte]))
            time.sleep(0.02)
            if time.monotonic() - started > HEADER_TIMEOUT / 2:
                break
        # Meanwhile everyone else is answered.
        assert request("POST", server.port, COMPLETIONS_PATH, completion(), AUTH)[0] == 200
        for sock in [*slow, silent]:
            status, body = http_error(read_all(sock, HEADER_TIMEOUT + 10))
            assert_openai_error(body, 408, None, f"within {HEADER_TIMEOUT} s (--timeout-header)")
            assert status == 408 and body["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < HEADER_TIMEOUT + 5
    finally:
        for sock in [*slow, silent]:
            sock.close()
    assert request("POST", server.port, COMPLETIONS_PATH, completion(), AUTH)[0] == 200


def test_a_body_that_trickles_in_gets_408_and_others_are_served(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    started = time.monotonic()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\nauthorization: " + AUTH["authorization"].encode() + b"\r\n\r\n{")
        assert request("POST", server.port, COMPLETIONS_PATH, completion(), AUTH)[0] == 200
        head, body = read_response(sock, HEADER_TIMEOUT + 10)
        assert int(head.split()[1]) == 408
        assert_openai_error(json.loads(body), 408, None, "request body did not arrive within")
        assert time.monotonic() - started < HEADER_TIMEOUT + 5
    finally:
        sock.close()


def test_an_idle_kept_alive_connection_is_closed(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read() == b""
        answered = time.monotonic()
        connection.sock.settimeout(KEEP_ALIVE + 2)
        assert connection.sock.recv(1) == b""  # closed by the server: EOF
        assert KEEP_ALIVE - 0.5 < time.monotonic() - answered < KEEP_ALIVE + 1.5
    finally:
        connection.close()


def test_connections_past_the_limit_get_503_and_the_server_goes_on(server):
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS + 5)]
    try:
        answers = [read_all(sock, 0.5) for sock in held[-5:]]
        for raw in answers:
            status, body = http_error(raw)
            assert status == 503 and body["error"]["code"] == "server_overloaded", body
            assert_openai_error(body, 503, None, f"{MAX_CONNECTIONS} connections open")
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: request("GET", server.port, "/health")[0] == 200, timeout=10)


def test_headers_over_the_size_limit_and_broken_http_get_openai_400s(server):
    # Headers not yet complete past the limit (the server buffers them while they are incomplete).
    for raw in (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 10000,
                b"NOT HTTP AT ALL\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(raw)
            status, body = http_error(read_all(sock, 10))
        assert status == 400 and body["error"]["code"] == "invalid_http"
        assert_openai_error(body, 400, None, "not valid HTTP/1.1")


def test_tool_call_arguments_json_cannot_hold_render_as_their_text(server):
    """An assistant turn's arguments are parsed to render them as an object; ones the parser
    refuses (an integer past its digit limit, nesting past its depth) stay text, as invalid JSON
    does, instead of failing the request."""
    for arguments in ('{"x": ' + "9" * 5000 + "}", '{"x": ' + "[" * 5000 + "]" * 5000 + "}"):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "ok", "tool_call_id": "c1"}]
        status, body = request("POST", server.port, "/tokenize", {"messages": messages}, AUTH)
        assert status == 200 and body["count"] > 0, body


def test_a_json_response_is_not_held_behind_a_delayed_ack(server):
    """Nagle's algorithm was on for connections to the socket weir serve binds: a response's body
    waited for the client's delayed ACK of its headers, 40 ms each, on a kept-alive connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        durations = []
        for _ in range(15):
            started = time.perf_counter()
            connection.request("GET", "/v1/models", headers=AUTH)
            assert connection.getresponse().read()
            durations.append(time.perf_counter() - started)
    finally:
        connection.close()
    assert sorted(durations)[len(durations) // 2] < 0.02, durations
