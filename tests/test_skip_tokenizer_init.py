"""``skip_tokenizer_init``: a checkpoint without tokenizer files runs, serves and benchmarks on
token ids alone; everything that needs text is refused with an error naming the option."""

from __future__ import annotations

import asyncio

import pytest

from helpers_models import make_tiny_llama
from server_helpers import request, stream_sse
from server_inprocess import serve_in_thread

from weir import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def no_tokenizer_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("no_tokenizer"), with_tokenizer=False)


@pytest.fixture(scope="module")
def token_ids_llm(no_tokenizer_path):
    return LLM(str(no_tokenizer_path), device="cpu", skip_tokenizer_init=True, max_model_len=128, block_size=4)


def test_a_folder_without_tokenizer_files_needs_the_option_and_says_so(no_tokenizer_path):
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(str(no_tokenizer_path), device="cpu", max_model_len=128)


def test_token_ids_in_token_ids_out_as_with_a_tokenizer(token_ids_llm, tiny_llama_path):
    output = token_ids_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert output.text == "" and len(output.token_ids) == 6
    # The same weights (same seed) with a tokenizer give the same ids: only the text is missing.
    with_tokenizer = LLM(str(tiny_llama_path), device="cpu", max_model_len=128, block_size=4)
    reference = with_tokenizer.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert reference.text != "" and output.token_ids == reference.token_ids
    with_logprobs = token_ids_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, logprobs=1),
                                           use_tqdm=False)[0].outputs[0]
    first = with_logprobs.logprobs[0][with_logprobs.token_ids[0]]
    assert first.rank == 1 and first.decoded_token is None


@pytest.mark.parametrize("call", ["text", "stop", "chat", "get_tokenizer"])
def test_what_needs_text_is_a_value_error_naming_the_option(token_ids_llm, call):
    calls = {
        "text": lambda: token_ids_llm.generate("hello", GREEDY, use_tqdm=False),
        "stop": lambda: token_ids_llm.generate([PROMPT], SamplingParams(stop=["x"]), use_tqdm=False),
        "chat": lambda: token_ids_llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False),
        "get_tokenizer": token_ids_llm.get_tokenizer,
    }
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        calls[call]()
    assert token_ids_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_options_that_need_a_tokenizer_are_refused_beside_it(no_tokenizer_path):
    with pytest.raises(ValueError, match="chat_template needs a tokenizer"):
        LLM(str(no_tokenizer_path), device="cpu", skip_tokenizer_init=True, chat_template="{{ x }}")


@pytest.fixture(scope="module")
def token_ids_server(no_tokenizer_path):
    with serve_in_thread(no_tokenizer_path, skip_tokenizer_init=True, block_size=4) as (port, _, _):
        yield port


def test_the_server_answers_token_id_completions_with_their_token_ids(token_ids_server, token_ids_llm):
    expected = token_ids_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, reply = request("POST", token_ids_server, "/v1/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == expected
    assert reply["usage"]["completion_tokens"] == 6
    streamed = asyncio.run(stream_sse(token_ids_server, "/v1/completions", {**body, "stream": True}))
    assert streamed.status == 200 and streamed.done
    ids = [token for event in streamed.events for choice in event["choices"] for token in choice.get("token_ids", [])]
    assert ids == expected
    assert streamed.events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["x"]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"prompt": "hello"}, "prompt"),
    ("/tokenize", {"prompt": "hello", "add_special_tokens": False}, "prompt"),
    ("/detokenize", {"tokens": PROMPT}, "tokens"),
])
def test_server_requests_that_need_text_are_400s_naming_the_option(token_ids_server, path, body, param):
    status, reply = request("POST", token_ids_server, path, {"model": "tiny", "max_tokens": 2, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert "skip_tokenizer_init" in reply["error"]["message"]
