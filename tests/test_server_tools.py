"""Tool calling and reasoning over HTTP (``--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3``), through the openai client: the template gets the tools, a reply in
Hermes format (``<tool_call>{json}</tool_call>``) comes back as ``tool_calls`` and its
``<think>...</think>`` part as ``reasoning_content``, whole or streamed. The tiny model's output
is scripted by replacing its logits, so the reply is known."""

from __future__ import annotations

import json

import pytest

from server_inprocess import CALL, scripted_tool_server
from weir.server.reasoning import ReasoningStream, parse_reasoning
from weir.server.tool_calls import ToolCallStream, parse_tool_calls

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
REPLY = "Sure.\n" + CALL


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    with scripted_tool_server(tiny_llama_path) as served:
        yield served


def test_a_tool_call_comes_back_as_tool_calls(served):
    client, script = served
    script.say(REPLY)
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                              tools=TOOLS, temperature=0, max_tokens=200)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.\n"  # vLLM keeps it verbatim
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert response.usage.prompt_tokens == len("TOOLS1|<user>weather?<assistant>")


def test_a_streamed_tool_call_arrives_whole_with_its_index(served):
    client, script = served
    script.say(REPLY)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                            tools=TOOLS, temperature=0, max_tokens=200, stream=True)
    content, calls, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Sure.\n"  # what the whole response says
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert reasons[-1] == "tool_calls"


def test_tool_choice_none_leaves_the_text_alone_and_a_tool_turn_renders(served):
    client, script = served
    script.say(REPLY)
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                              tools=TOOLS, tool_choice="none", temperature=0, max_tokens=200)
    assert response.choices[0].message.content == REPLY and not response.choices[0].message.tool_calls
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    script.say("Sunny.")
    follow_up = client.chat.completions.create(
        model="tiny", tools=TOOLS, temperature=0, max_tokens=20,
        messages=[{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert follow_up.choices[0].message.content == "Sunny." and follow_up.choices[0].finish_reason == "stop"
    # The template gets the arguments as an object (vLLM does the same): `tojson` would encode a string twice.
    rendered_call = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert follow_up.usage.prompt_tokens == len(f"TOOLS1|<user>weather?<assistant>{json.dumps([rendered_call])}"
                                                f"<tool>sunny<assistant>")


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    client, script = served
    request = dict(messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, parallel_tool_calls=False)
    script.say(CALL + "\n" + CALL.replace("Paris", "Rome"))
    calls = client.chat.completions.create(model="tiny", temperature=0, max_tokens=200, **request).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in calls.message.tool_calls] == ["Paris"]
    script.say(CALL + "\n" + CALL.replace("Paris", "Rome"))
    _, _, streamed, _ = stream_parts(client, **request)
    assert [json.loads(c.function.arguments)["city"] for c in streamed] == ["Paris"]


def test_parser_takes_end_tags_inside_arguments_and_unclosed_blocks():
    tricky = '<tool_call>{"name": "f", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call>'
    for text, arguments in ((tricky, {"code": "print('</tool_call>')"}),
                            ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', {"x": 1})):  # stopped early
        content, calls = parse_tool_calls(text)
        assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [arguments]
        stream, streamed = ToolCallStream(), []
        for character in text:
            streamed += stream.feed(character)[1]
        streamed += stream.feed("", finished=True)[1]
        assert [json.loads(c["function"]["arguments"]) for c in streamed] == [arguments]


def test_parser_keeps_what_is_not_a_call():
    assert parse_tool_calls("plain text") == ("plain text", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    content, calls = parse_tool_calls('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> b')
    assert content == "a  b" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert parse_tool_calls(CALL + "\n" + CALL + "\n")[0] is None  # the newlines between calls are not content
    stream = ToolCallStream()
    pieces = [stream.feed(piece) for piece in ("hi <tool", "_call>{\"name\": \"f\"}</tool", "_call> <tool_ca")]
    # Tags split across deltas are held back, and so is whitespace after a call until text follows.
    assert [piece[0] for piece in pieces] == ["hi ", "", ""]
    assert pieces[0][1] == pieces[1][1] == [] and [(c["index"], c["function"]["name"]) for c in pieces[2][1]] == \
        [(0, "f")]
    assert stream.feed("", finished=True) == (" <tool_ca", [])  # an unfinished tag is text after all
    unclosed = ToolCallStream()
    assert unclosed.feed('<tool_call>{"name"', finished=True) == ('<tool_call>{"name"', [])


def stream_parts(client, **request) -> tuple[str, str, list, str]:
    """(reasoning, content, tool call deltas, last finish reason) of a streamed chat completion."""
    reasoning, content, calls, reason = "", "", [], None
    for chunk in client.chat.completions.create(model="tiny", temperature=0, max_tokens=200, stream=True, **request):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, content, calls, reason


def test_thinking_goes_to_reasoning_content(served):
    client, script = served
    messages = [{"role": "user", "content": "hi"}]
    for reply, reasoning, content in (("<think>\nplan\n</think>\n\nHello", "\nplan\n", "\n\nHello"),
                                      ("Hello", None, "Hello"), ("<think>cut off", "cut off", None)):
        script.say(reply)
        message = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                 max_tokens=200).choices[0].message
        assert (getattr(message, "reasoning_content", None), message.content) == (reasoning, content)
        script.say(reply)
        assert stream_parts(client, messages=messages)[:2] == (reasoning or "", content or "")


def test_reasoning_then_a_tool_call(served):
    client, script = served
    reply = "<think>need weather</think>" + CALL
    script.say(reply)
    choice = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                            tools=TOOLS, temperature=0, max_tokens=200).choices[0]
    assert choice.message.reasoning_content == "need weather" and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    script.say(reply)
    reasoning, content, calls, reason = stream_parts(client, messages=[{"role": "user", "content": "weather?"}],
                                                     tools=TOOLS)
    assert (reasoning, content, [c.function.name for c in calls], reason) == \
        ("need weather", "", ["get_weather"], "tool_calls")


def test_reasoning_parser_holds_back_split_tags():
    assert parse_reasoning("  <think>a</think>b") == ("a", "b") and parse_reasoning("") == (None, None)
    stream = ReasoningStream()
    pieces = [stream.feed(piece) for piece in ("\n<th", "ink>ab</th", "ink>c")]
    assert pieces == [("", ""), ("ab", ""), ("", "c")]
    assert ReasoningStream().feed("<thi", finished=True) == ("", "<thi")  # never a tag: content


def test_a_tool_call_json_cannot_hold_stays_text():
    """The model's own output: an integer past int()'s digit limit or nesting past the parser's
    depth is no call (as invalid JSON is), rather than a failed request."""
    for arguments in ("9" * 5000, "[" * 5000 + "]" * 5000):
        text = '<tool_call>\n{"name": "f", "arguments": {"x": ' + arguments + '}}\n</tool_call>'
        content, calls = parse_tool_calls(text)
        assert calls == [] and content == text
        stream = ToolCallStream()
        streamed, streamed_calls = stream.feed(text, finished=True)
        assert streamed_calls == [] and streamed == text


def test_a_tool_call_naming_a_lone_surrogate_stays_text():
    """JSON's \\ud800 escape decodes to a lone surrogate, which no response can carry (UTF-8
    cannot encode it): a call holding one, in its name or arguments, stays the model's text."""
    for text in ('<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>',
                 '<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>'):
        content, calls = parse_tool_calls(text)
        assert calls == [] and content == text
        assert ToolCallStream().feed(text, finished=True) == (text, [])
