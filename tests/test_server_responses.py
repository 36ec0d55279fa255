"""``POST /v1/responses`` through the openai client: text, instructions and message items render
through the chat template; the reply comes back as output items (reasoning, message, function
calls), whole or as typed stream events; what a stateless text server cannot do is a 400. The
tiny model's reply is scripted (``server_inprocess.ScriptedReply``), so the output is known."""

from __future__ import annotations

import json

import openai
import pytest

from server_inprocess import CALL, scripted_tool_server

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    with scripted_tool_server(tiny_llama_path) as served:
        yield served


def test_text_in_text_out(served):
    client, script = served
    script.say("Hi there.")
    response = client.responses.create(model="tiny", input="hello", instructions="be brief", temperature=0)
    assert response.status == "completed" and response.output_text == "Hi there."
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.usage.input_tokens == len("<system>be brief<user>hello<assistant>")
    assert response.usage.output_tokens == len("Hi there.") + 1  # and EOS
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_message_items_function_calls_and_their_outputs_render_as_chat(served):
    client, script = served
    script.say("It is sunny.")
    response = client.responses.create(model="tiny", temperature=0, tools=TOOLS, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather"}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    assert response.output_text == "It is sunny."
    rendered = ('TOOLS1|<user>weather\n?<assistant>[{"function": {"arguments": {"city": "Paris"}, "name": '
                '"get_weather"}, "id": "call_1", "type": "function"}]<tool>sunny<assistant>')
    assert response.usage.input_tokens == len(rendered)


def test_reasoning_and_a_function_call_come_back_as_items(served):
    client, script = served
    script.say("<think>look it up</think>" + CALL)
    response = client.responses.create(model="tiny", input="weather?", tools=TOOLS, temperature=0)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "look it up"
    assert response.usage.output_tokens_details.reasoning_tokens == len("look it up")  # a byte per token
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_a_reply_cut_by_max_output_tokens_is_incomplete(served):
    client, script = served
    script.say("A long answer.")
    response = client.responses.create(model="tiny", input="hello", max_output_tokens=4, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "A lo" and response.output[0].status == "incomplete"


def test_a_stream_sends_typed_events_in_order(served):
    client, script = served
    script.say("<think>hm</think>Hi." + CALL)
    events = list(client.responses.create(model="tiny", input="hello", tools=TOOLS, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "hm"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hi."
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert added == [item.type for item in done] == ["reasoning", "message", "function_call"]
    assert json.loads(done[2].arguments) == {"city": "Paris"} and done[1].content[0].text == "Hi."
    final = events[-1].response
    assert final.status == "completed" and [item.type for item in final.output] == added
    assert final.output_text == "Hi." and final.usage.output_tokens > 0
    # The reasoning item was open until the message started: its text is whole in done and final.
    assert done[0].content[0].text == final.output[0].content[0].text == "hm"


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(served):
    client, script = served
    script.say("A long answer.")
    events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=3, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete" and events[-1].response.output_text == "A l"


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0"),
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"extra_body": {"logit_bias": {"5": 1.0}}}, "logit_bias"),
    ({"extra_body": {"structured_outputs": {"json": {}}}}, "structured_outputs"),
])
def test_what_a_stateless_text_server_cannot_do_is_a_400_naming_the_field(served, fields, param):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**{"model": "tiny", "input": "hello", **fields})
    assert error.value.body["param"] == param


def test_the_model_name_is_checked(served):
    client, _ = served
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-6", input="hello")


def test_whole_and_streamed_responses_carry_the_same_items_and_validate_strictly(served):
    """Text after a tool call, a reasoning-only reply and an empty one: the same items either way,
    and every body and event parses with the client's own models."""
    from openai.types.responses import Response

    client, script = served
    for reply, expected in [("A." + CALL + "B.", ["message", "function_call", "message"]),
                            ("<think>only thinking</think>", ["reasoning"]),
                            ("", ["message"])]:
        script.say(reply)
        whole = client.responses.with_raw_response.create(model="tiny", input="hi", tools=TOOLS, temperature=0)
        body = Response.model_validate_json(whole.text, strict=True)
        script.say(reply)
        events = list(client.responses.create(model="tiny", input="hi", tools=TOOLS, temperature=0, stream=True))
        final = events[-1].response
        assert [item.type for item in body.output] == [item.type for item in final.output] == expected, reply
        assert body.output_text == final.output_text
        assert not any(event.type.endswith(".delta") and event.delta == "" for event in events
                       if hasattr(event, "delta"))


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call", "name": "get_weather", "arguments": "{}"}, "input.0.call_id"),
    ({"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": {"city": "x"}},
     "input.0.arguments"),
    ({"type": "function_call_output", "call_id": "c", "output": 3}, "input.0.output"),
    ({"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}, "input.0.content"),
])
def test_malformed_items_are_400s_naming_the_field(served, item, param):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="tiny", input=[item])
    assert error.value.body["param"] == param


def test_a_function_call_output_given_as_text_parts_is_joined(served):
    client, script = served
    script.say("ok")
    response = client.responses.create(model="tiny", temperature=0, input=[
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "sun"}, {"type": "input_text", "text": "ny"}]}])
    rendered = '<assistant>[{"function": {"arguments": {}, "name": "get_weather"}, "id": "c1", "type": "function"}]' \
               '<tool>sun\nny<assistant>'
    assert response.usage.input_tokens == len(rendered)
