"""The official ``openai`` client against a real ``weir serve`` process on a tiny model."""

from __future__ import annotations

import openai
import pytest

from server_helpers import SERVED_NAME, ServerProcess, request

pytestmark = pytest.mark.integration

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Name a river."}]
# The tiny model is random: greedy decoding tends to repeat tokens that decode to no text, so
# tests that compare texts sample with a fixed seed instead.
SEEDED = dict(temperature=1.0, seed=5, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    process = ServerProcess(tiny_llama_path, tmp_path_factory.mktemp("serve") / "serve.log")
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [SERVED_NAME]
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME


def test_chat_non_streaming_shape(client):
    completion = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=12, **SEEDED)
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == SERVED_NAME and completion.system_fingerprint
    choice = completion.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content and choice.logprobs is None
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    kwargs = dict(model=SERVED_NAME, messages=CHAT, max_tokens=16, **SEEDED)
    reference = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text and text == reference.choices[0].message.content
    reasons = [chunk.choices[0].finish_reason for chunk in chunks
               if chunk.choices and chunk.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == reference.usage.prompt_tokens


def test_chat_n2_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=SERVED_NAME, messages=CHAT, max_tokens=10, temperature=1.0, seed=1234, n=2,
                  extra_body={"ignore_eos": True})
    first, second = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.usage.completion_tokens == 20
    other_seed = client.chat.completions.create(**{**kwargs, "seed": 99, "n": 1, "max_tokens": 24})
    same_seed = client.chat.completions.create(**{**kwargs, "n": 1, "max_tokens": 24})
    assert other_seed.choices[0].message.content != same_seed.choices[0].message.content


def test_chat_streaming_n2_keeps_choices_apart(client):
    kwargs = dict(model=SERVED_NAME, messages=CHAT, max_tokens=8, seed=7, n=2, extra_body={"ignore_eos": True})
    reference = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in reference.choices}


def test_chat_logprobs(client):
    completion = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = completion.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0 and isinstance(entry.bytes, list)
        tops = [top.logprob for top in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy picks the most likely token
    stream = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model=SERVED_NAME, prompt="Once upon", max_tokens=24,
                                     **SEEDED).choices[0].text
    stop = [char for char in full[1:] if char.isascii() and char.isalnum()][0]
    assert full.index(stop) >= 1
    for stream in (False, True):
        response = client.completions.create(model=SERVED_NAME, prompt="Once upon", max_tokens=24, stop=[stop],
                                             stream=stream, **SEEDED)
        if stream:
            chunks = list(response)
            text = "".join(chunk.choices[0].text for chunk in chunks)
            reason = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason]
        else:
            text, reason = response.choices[0].text, [response.choices[0].finish_reason]
        assert text == full[:full.index(stop)] and reason == ["stop"]


def test_completions_shapes_echo_logprobs_and_token_prompts(client):
    completion = client.completions.create(model=SERVED_NAME, prompt="abc", max_tokens=5, logprobs=2, **SEEDED)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 5
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0
    assert choice.text and logprobs.text_offset[1] == len(logprobs.tokens[0])
    echoed = client.completions.create(model=SERVED_NAME, prompt="abc", max_tokens=5, echo=True, **SEEDED)
    assert echoed.choices[0].text == "abc" + choice.text
    token_ids = [97, 98, 99]  # the tiny tokenizer maps byte b to token id b
    by_ids = client.completions.create(model=SERVED_NAME, prompt=token_ids, max_tokens=5, **SEEDED)
    assert by_ids.choices[0].text == choice.text and by_ids.usage.prompt_tokens == 3
    batch = client.completions.create(model=SERVED_NAME, prompt=["abc", "xyz"], max_tokens=5, n=2, **SEEDED)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == choice.text  # choice i of a prompt samples with seed + i
    assert batch.usage.prompt_tokens == 6 and batch.usage.completion_tokens == 20


def test_completions_stream_usage(client):
    chunks = list(client.completions.create(model=SERVED_NAME, prompt="abc", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].choices == []
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_max_tokens_past_the_context_is_an_error_naming_both_lengths(client):
    """As vLLM: a completion that cannot fit is refused, not quietly cut short; without a
    max_tokens, chat runs up to the context's end."""
    for create, field, extra in ((client.completions.create, "max_tokens", {"prompt": "abc"}),
                                 (client.chat.completions.create, "max_completion_tokens",
                                  {"messages": [{"role": "user", "content": "abc"}]})):
        with pytest.raises(openai.BadRequestError) as caught:
            create(model=SERVED_NAME, **{field: 254}, **extra)
        error = caught.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == field
        assert "maximum context length is 256 tokens" in error["message"] and "254 >" in error["message"]
    completion = client.completions.create(model=SERVED_NAME, prompt="abc", max_tokens=253,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == 256
    chat = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "abc"}],
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.total_tokens == 256


def test_tokenize_detokenize_health_version(server):
    status, body = request("POST", server.port, "/tokenize", {"prompt": "hi!"})
    assert status == 200 and body["tokens"] == [104, 105, 33] and body["count"] == 3
    status, body = request("POST", server.port, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["count"] == len("<|user|>hi\n<|assistant|>")
    assert request("POST", server.port, "/detokenize", {"tokens": [104, 105]}) == (200, {"prompt": "hi"})
    assert request("GET", server.port, "/health")[0] == 200
    assert request("GET", server.port, "/version") == (200, {"version": "0.1.0"})
