"""What users of vLLM's OpenAI server expect beyond the base API: template variables
(``chat_template_kwargs``, ``reasoning_effort``), ``continue_final_message``, text content parts
joined by newlines, ``stop_reason`` on every finished choice, and CORS for browser clients."""

from __future__ import annotations

import http.client

import pytest

from server_helpers import request
from server_inprocess import serve_in_thread

pytestmark = pytest.mark.integration

# Prints the template variables a request may set, so the rendered prompt (one token per
# character with the tiny tokenizer) shows whether they arrived.
TEMPLATE = ("{% if greeting %}{{ greeting }}|{% endif %}{% if reasoning_effort %}effort={{ reasoning_effort }}|"
            "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def port(tiny_llama_path):
    with serve_in_thread(tiny_llama_path, chat_template=TEMPLATE) as (port, _, _):
        yield port


def prompt_tokens(port: int, **fields) -> int:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}
    status, answer = request("POST", port, CHAT, body)
    assert status == 200, answer
    return answer["usage"]["prompt_tokens"]


def test_template_variables_reach_the_chat_template(port):
    assert prompt_tokens(port) == len("<user>hi<assistant>")
    assert prompt_tokens(port, chat_template_kwargs={"greeting": "hey"}) == len("hey|<user>hi<assistant>")
    assert prompt_tokens(port, reasoning_effort="low") == len("effort=low|<user>hi<assistant>")


def test_text_parts_are_joined_by_newlines(port):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert prompt_tokens(port, messages=[{"role": "user", "content": parts}]) == len("<user>a\nb<assistant>")


def test_continue_final_message_extends_the_assistant_turn(port):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    assert (prompt_tokens(port, messages=messages, add_generation_prompt=False, continue_final_message=True)
            == len("<user>hi<assistant>The answer is"))


def test_finished_choices_carry_stop_reason(port):
    greedy = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, answer = request("POST", port, "/v1/completions", greedy)
    assert status == 200 and answer["choices"][0]["stop_reason"] is None  # ran to max_tokens
    text = answer["choices"][0]["text"]
    stop = text[3:5]
    status, answer = request("POST", port, "/v1/completions", {**greedy, "stop": [stop]})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop and stop not in choice["text"]
    status, answer = request("POST", port, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "ignore_eos": True})
    assert answer["choices"][0]["finish_reason"] == "length" and answer["choices"][0]["stop_reason"] is None


def test_browser_preflight_is_allowed(port):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("OPTIONS", CHAT, headers={"origin": "http://localhost:3000",
                                                      "access-control-request-method": "POST",
                                                      "access-control-request-headers": "content-type"})
        response = connection.getresponse()
        response.read()
        assert response.status == 200 and response.getheader("access-control-allow-origin") == "*"
    finally:
        connection.close()


def test_usage_reports_cached_prompt_tokens(port):
    body = {"prompt": "a long enough prompt to fill a few blocks of the cache", "max_tokens": 1}
    status, first = request("POST", port, "/v1/completions", body)
    status, again = request("POST", port, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
