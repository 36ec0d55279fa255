"""Bad requests, API keys, body limits, admission control and /metrics on a real server."""

from __future__ import annotations

import asyncio
import http.client

import pytest

from server_helpers import SERVED_NAME, ServerProcess, metric, request, scrape_metrics, stream_sse

pytestmark = pytest.mark.integration

API_KEY = "s3cret"
AUTH = {"authorization": f"Bearer {API_KEY}"}
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    # The key comes from the environment, as WEIR_API_KEY documents.
    process = ServerProcess(tiny_llama_path, tmp_path_factory.mktemp("serve") / "serve.log",
                            "--max-num-queued-reqs", "4", "--max-request-body-bytes", str(BODY_LIMIT),
                            env={"WEIR_API_KEY": API_KEY})
    yield process
    assert process.stop() == 0, process.log()


def chat(**fields):
    return {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields):
    return {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 4, **fields}


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
    # json.dumps escapes the lone surrogate as \ud800: valid JSON, text no tokenizer takes.
    ("lone-surrogate-prompt", COMPLETIONS_PATH, completion(prompt="\ud800abc"), AUTH, 400, "prompt",
     "cannot be tokenized"),
    ("lone-surrogate-tokenize", "/tokenize", {"prompt": "\ud800abc"}, AUTH, 400, "prompt", "cannot be tokenized"),
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
