"""What a stream shows of a reply made of bytes that are no whole character: the tiny model's
output is scripted (token b is byte b), so the reply is known. A run of lone UTF-8 lead bytes
must reach the client within a few tokens, not all at once at the end, and the streamed text must
be what ``tokenizer.decode`` of the reply shows, also cut at stop strings. Tokens that show no
text at all (special tokens, skipped) still move the stream, as in vLLM."""

from __future__ import annotations

import asyncio

import pytest

from helpers_models import TINY_EOS_ID, TINY_PAD_ID
from server_helpers import stream_sse
from server_inprocess import ScriptedReply, serve_in_thread

pytestmark = pytest.mark.integration  # a real server over HTTP

LONE_LEADS = [0xE2] * 20 + list(b"a")
WITH_STOP = [0xE2] * 10 + list(b"x stop y") + [0xF0] * 4


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    with serve_in_thread(tiny_llama_path, max_num_seqs=1) as (port, engine, _):
        yield port, ScriptedReply(engine.engine), engine.engine.tokenizer


def streamed_completion(port, script, reply, **fields):
    """The streamed text, and how many tokens had come when the first text did."""
    script.tokens = list(reply) + [TINY_EOS_ID]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 64, "stream": True, "logprobs": 0, **fields}
    result = asyncio.run(stream_sse(port, "/v1/completions", body))
    assert result.status == 200 and result.done, result
    text, num_tokens, tokens_at_first_text = "", 0, None
    for event in result.events:
        choice = event["choices"][0]
        num_tokens += len((choice["logprobs"] or {}).get("tokens", []))
        if choice["text"] and tokens_at_first_text is None:
            tokens_at_first_text = num_tokens
        text += choice["text"]
    return text, tokens_at_first_text


def test_lone_lead_bytes_reach_the_client_within_a_few_tokens(served):
    port, script, tokenizer = served
    text, tokens_at_first_text = streamed_completion(port, script, LONE_LEADS)
    assert text == tokenizer.decode(LONE_LEADS) == "\ufffd" * 20 + "a"
    assert tokens_at_first_text <= 4  # no character has more than 4 bytes


@pytest.mark.parametrize("keep_stop", [False, True], ids=["stop-cut", "include-stop-str"])
def test_stop_strings_after_lone_lead_bytes(served, keep_stop):
    port, script, tokenizer = served
    text, tokens_at_first_text = streamed_completion(port, script, WITH_STOP, stop=["stop"],
                                                     include_stop_str_in_output=keep_stop)
    whole = tokenizer.decode(WITH_STOP)
    assert text == whole[:whole.index("stop") + (len("stop") if keep_stop else 0)]
    assert tokens_at_first_text <= 4 + (0 if keep_stop else len("stop") - 1)  # a stop's start is withheld


def test_chat_stream_of_lone_lead_bytes(served):
    port, script, tokenizer = served
    script.tokens = LONE_LEADS + [TINY_EOS_ID]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True,
            "logprobs": True}
    result = asyncio.run(stream_sse(port, "/v1/chat/completions", body))
    assert result.status == 200 and result.done
    text, num_tokens, tokens_at_first_text = "", 0, None
    for event in result.events:
        choice = event["choices"][0]
        num_tokens += len((choice["logprobs"] or {}).get("content", []))
        content = choice["delta"].get("content") or ""
        if content and tokens_at_first_text is None:
            tokens_at_first_text = num_tokens
        text += content
    assert text == tokenizer.decode(LONE_LEADS)
    assert tokens_at_first_text <= 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tokens_without_text_still_stream(served, path):
    """A reply of special tokens only shows no text, but each step's tokens get a chunk: a client
    (and ``bench serve``, which timed no first token here) sees the stream move before it ends."""
    port, script, _ = served
    script.tokens = [TINY_PAD_ID] * 8 + list(b"a") + [TINY_PAD_ID] * 8 + [TINY_EOS_ID]
    body = {"model": "tiny", "max_tokens": 64, "stream": True}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    result = asyncio.run(stream_sse(port, path, body))
    assert result.status == 200 and result.done
    texts = []  # the text of every chunk that carries tokens, the opening role and the closing one aside
    for event in result.events:
        choice = event["choices"][0]
        if choice["finish_reason"] is None and "role" not in choice.get("delta", {}):
            texts.append(choice["text"] if "text" in choice else choice["delta"].get("content") or "")
    assert "".join(texts) == "a"
    assert texts.index("a") > 0 and len(texts) > texts.index("a") + 1, texts
