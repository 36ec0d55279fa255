"""The server's pure parts without a server: admission control, error shapes, request schemas,
logprob shapes, token bytes."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from weir.outputs import Logprob
from weir.server.admission import AdmissionControl
from weir.server.errors import APIError, from_validation_error, from_value_error
from weir.server.logprobs import TokenBytes, chat_logprobs, completion_logprobs
from weir.server.protocol import ChatCompletionRequest, CompletionRequest
from weir.server.streaming import EventStreamResponse


def test_admission_limits_requests_and_queued_prompt_tokens():
    control = AdmissionControl(max_num_queued_reqs=2, max_num_queued_tokens=100)
    first = control.admit(60)
    with pytest.raises(APIError) as rejected:
        control.admit(50)  # 60 + 50 queued prompt tokens > 100
    assert rejected.value.status == 503 and "--max-num-queued-tokens" in rejected.value.message
    first.started()  # its prefill ran: its tokens no longer count as queued
    second = control.admit(50)
    with pytest.raises(APIError, match="--max-num-queued-reqs"):
        control.admit(1)
    first.release()
    first.release()  # idempotent
    second.release()
    assert (control.num_requests, control.num_waiting_tokens, control.num_rejected) == (0, 0, 2)
    big = control.admit(500)  # bigger than the token limit, but nothing else waits: it may run
    big.release()


def test_validation_errors_name_the_field_without_union_tags():
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": [1, "a"]})
    error = from_validation_error(caught.value)
    assert error.status == 400 and error.param.startswith("prompt") and "list[" not in error.param
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    assert from_validation_error(caught.value).param == "messages.0.content"
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"messages": [], "temperature": "1"})  # strict: no coercion
    assert from_validation_error(caught.value).param == "temperature"


def test_value_errors_map_engine_fields_onto_request_fields():
    assert from_value_error(ValueError("top_p must be in (0, 1], got 2")).param == "top_p"
    error = from_value_error(ValueError("logprobs=30 is more than max_logprobs=20"),
                             renamed={"logprobs": "top_logprobs"})
    assert error.param == "top_logprobs"
    error = from_value_error(ValueError("the prompt has 300 tokens, but max_model_len is 256"),
                             default_param="prompt")
    assert (error.param, error.code) == ("prompt", "context_length_exceeded")
    assert error.body() == {"error": {"message": "the prompt has 300 tokens, but max_model_len is 256",
                                      "type": "invalid_request_error", "param": "prompt",
                                      "code": "context_length_exceeded"}}


def test_chat_sampling_params_follow_openai_defaults():
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                                                 "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3})
    chat.check_supported()
    params = chat.to_sampling_params({})
    assert (params.max_tokens, params.logprobs, params.temperature) == (5, 3, 1.0)
    unbounded = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert unbounded.to_sampling_params({}).max_tokens is None  # the engine clamps to the context
    completion = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "top_k": -1})
    assert completion.prompts() == [[1, 2], [3]] and completion.to_sampling_params({}).max_tokens == 16
    # The model's generation_config fills what the request left out, and only that.
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    params = CompletionRequest.model_validate({"prompt": "hi", "top_k": -1}).to_sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 0)
    # max_new_tokens from the file bounds a chat reply that sets no max_tokens.
    assert unbounded.to_sampling_params({"max_tokens": 7}).max_tokens == 7
    assert chat.to_sampling_params({"max_tokens": 7}).max_tokens == 5


def test_logprob_shapes(tiny_llama_path):
    from transformers import AutoTokenizer

    token_bytes = TokenBytes(AutoTokenizer.from_pretrained(tiny_llama_path))
    # byte 0xC3 is half of "é": its text is U+FFFD, its bytes must still be [0xC3]
    entries = [{0xC3: Logprob(-0.5, 1, "\ufffd"), 65: Logprob(-1.5, 2, "A")},
               {66: Logprob(-2.0, 3, "B"), 65: Logprob(-0.1, 1, "A"), 67: Logprob(-0.9, 2, "C")}]
    content = chat_logprobs([0xC3, 66], entries, 2, token_bytes)
    assert content[0]["bytes"] == [0xC3] and content[1]["bytes"] == [66]
    assert [top["token"] for top in content[1]["top_logprobs"]] == ["A", "C"]
    legacy, end = completion_logprobs([0xC3, 66], entries, text_offset=3)
    assert legacy["tokens"] == ["\ufffd", "B"] and legacy["text_offset"] == [3, 4] and end == 5
    assert legacy["top_logprobs"][1] == {"A": -0.1, "C": -0.9, "B": -2.0}


def test_serve_refuses_a_port_outside_the_tcp_range():
    from typer.testing import CliRunner

    from weir.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--port", "70000"])
    assert result.exit_code == 2 and "65535" in result.output  # a usage error, before any model loads


def test_tpot_is_per_completion_when_n_is_above_one():
    """n completions run side by side: TPOT divides each one's time by its own tokens."""
    from weir.server.metrics import RequestRecord, ServerMetrics

    metrics = ServerMetrics()
    record = RequestRecord(num_prompt_tokens=5, arrival_time=0.0, first_token_time=0.0)
    metrics.finished(record, ["length"] * 4, [40] * 4)
    count = metrics.registry.get_sample_value("weir:time_per_output_token_seconds_count")
    total = metrics.registry.get_sample_value("weir:time_per_output_token_seconds_sum")
    assert count == 4 and record.num_generated_tokens == 160
    elapsed = metrics.registry.get_sample_value("weir:e2e_request_latency_seconds_sum")
    assert abs(total - 4 * elapsed / 39) < 1e-6 * max(1.0, elapsed)


def test_a_known_unsupported_field_is_one_400_not_also_an_ignored_field(caplog):
    """prompt_logprobs was logged as "ignoring unknown request field" and then refused."""
    from weir.server.body import parse

    with caplog.at_level("WARNING", logger="weir.server.body"):
        request = parse(CompletionRequest, {"prompt": "hi", "prompt_logprobs": 1, "my_own_field": 2})
    assert [record.getMessage() for record in caplog.records] == ["ignoring unknown request field(s): my_own_field"]
    with pytest.raises(APIError) as refused:
        request.check_supported()
    assert (refused.value.status, refused.value.param, refused.value.code) == \
        (400, "prompt_logprobs", "unsupported_parameter")
    assert "prompt_logprobs is not supported" in refused.value.message


@pytest.mark.parametrize("name", ["timeout_keep_alive", "timeout_header", "max_connections",
                                  "h11_max_incomplete_event_size"])
def test_connection_limits_must_be_positive(name):
    from weir.server.settings import ServerSettings

    with pytest.raises(ValueError, match=f"{name} must be positive"):
        ServerSettings(**{name: 0})


def test_an_error_echoing_a_lone_surrogate_still_renders():
    """Request bodies are checked for them; an error body that echoes one anyway is escaped."""
    import json

    response = APIError(404, "The model '\ud800' does not exist", param="model").response()
    assert json.loads(response.body)["error"]["message"] == "The model '\ud800' does not exist"


def test_a_stream_cancelled_while_it_cleans_up_still_closes_and_raises_nothing():
    """The server's shutdown cancel can land just after a stream's last event, while it closes
    its event source: the cleanup still runs to the end (on_close too) and the handler returns
    quietly (uvicorn logged the CancelledError as an ASGI failure)."""
    async def scenario():
        closing, release = asyncio.Event(), asyncio.Event()
        closed = []

        class Events:
            def __init__(self):
                self.sent = False

            def __aiter__(self):
                return self

            async def __anext__(self):
                if self.sent:
                    raise StopAsyncIteration
                self.sent = True
                return b"data: {}\n\n"

            async def aclose(self):
                closing.set()
                await release.wait()  # the server's cancel arrives here
                closed.append("events")

        async def receive():
            await asyncio.Event().wait()  # the client never leaves

        sent = []

        async def send(message):
            sent.append(message)

        response = EventStreamResponse(Events(), on_close=lambda: closed.append("on_close"))
        handler = asyncio.create_task(response(None, receive, send))
        await closing.wait()
        handler.cancel()
        await asyncio.sleep(0)
        release.set()
        await handler  # raises CancelledError if the cancel escaped the cleanup
        return closed, sent

    closed, sent = asyncio.run(scenario())
    assert closed == ["events", "on_close"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}  # ended normally
