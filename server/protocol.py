"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), validated by pydantic.

Strict types: ``"0.5"`` is not a temperature and ``1`` is not ``true``, as with OpenAI. Fields
this server does not know are ignored (as vLLM does) and logged; known fields whose feature is
not supported (logit_bias, guided decoding, ...) are answered with a 400 naming them. Tools are
served with ``--enable-auto-tool-choice --tool-call-parser hermes`` (``weir.server.tool_calls``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from weir.sampling_params import SamplingParams
from weir.server.errors import bad_request, unsupported
from weir.tokenizer import UnsupportedContent, template_message

# OpenAI's limit: each choice is a sequence the engine schedules, so one request must not be able
# to queue an unbounded number of them ahead of everyone else.
MAX_N = 128
# What apply_chat_template is called with by the server itself; a request may not override it.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize",
                                      "return_dict", "return_tensors", "tokenizer_kwargs"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, rendered by the template
    tool_call_id: str | None = None  # a tool turn's answer to that call

    def as_template_message(self, index: int) -> dict[str, Any]:
        """The message as chat templates take it (``weir.tokenizer.template_message``)."""
        fields = self.model_dump(include={"role", "content", "name", "tool_calls", "tool_call_id"}, exclude_none=True)
        try:
            return template_message(fields, index)
        except UnsupportedContent as error:
            raise unsupported(error.param, error.what) from error


# vLLM extensions that change what is generated or returned; Weir has none of them yet, so a
# request asking for one is refused rather than answered as if it had been honoured.
UNSUPPORTED_VLLM_FIELDS = {
    "structured_outputs": "structured outputs",
    "guided_json": "guided decoding", "guided_regex": "guided decoding", "guided_choice": "guided decoding",
    "guided_grammar": "guided decoding",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "prompt_logprobs": "prompt_logprobs",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "return_token_ids": "return_token_ids",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "logits_processors": "logits_processors",
    "documents": "documents (RAG templates)",
    "mm_processor_kwargs": "multimodal inputs",
    "vllm_xargs": "vllm_xargs",
}


# The sampling fields a checkpoint's generation_config may default (weir.model_files).
DEFAULTABLE_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                               "repetition_penalty")


def sampling_fields_with_defaults(request: BaseModel, defaults: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling fields, the checkpoint's defaults filling those it left out (and
    has); fields neither sets stay out, for SamplingParams' own defaults."""
    chosen = {}
    for name in DEFAULTABLE_SAMPLING_FIELDS:
        value = getattr(request, name, None)
        value = defaults.get(name) if value is None else value
        if value is not None:
            chosen[name] = value
    return chosen


class _SamplingRequest(_Strict):
    """Fields shared by chat and completions, with vLLM's extras."""

    # Not fields, but names ``check_supported`` looks for among the unknown ones (and refuses when
    # asked for), so they are not logged as ignored.
    CHECKED_EXTRA_FIELDS: ClassVar[frozenset[str]] = frozenset(UNSUPPORTED_VLLM_FIELDS)
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_common(self) -> None:
        for name, value in (self.model_extra or {}).items():
            asked = not (value is None or value is False or (isinstance(value, (list, dict)) and not value))
            if name in UNSUPPORTED_VLLM_FIELDS and asked:  # prompt_logprobs=0 still asks for them
                raise unsupported(name, UNSUPPORTED_VLLM_FIELDS[name])
        if self.n > MAX_N:
            raise bad_request(f"n must be <= {MAX_N}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise unsupported("stream_options.continuous_usage_stats", "continuous_usage_stats")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any]) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range. ``defaults`` (the
        model's generation_config values) fill the sampling fields the request left out."""
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or [], logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            **sampling_fields_with_defaults(self, defaults),
        )


class _ToolOptions:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as chat and responses share them
    (a mixin of methods only: the fields are each request's own)."""

    tools: list[dict] | None
    tool_choice: str | dict | None
    parallel_tool_calls: bool | None

    @property
    def max_tool_calls(self) -> int | None:
        """``parallel_tool_calls: false`` keeps the first call only, as vLLM does."""
        return 1 if self.parallel_tool_calls is False else None

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the reply's text is parsed for tool calls (tools given, tool_choice "auto")."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def check_tool_choice(self, tool_call_parser: str | None) -> None:
        """``tool_call_parser``: the server's, when it serves tool_choice "auto" (else None)."""
        if self.tool_choice not in (None, "none", "auto"):
            raise unsupported("tool_choice", f"tool_choice={self.tool_choice!r} (it needs guided decoding; "
                                             f"'auto' and 'none' are served)")
        if self.parses_tool_calls and tool_call_parser is None:
            raise unsupported("tools", "tool calling on this server (start it with --enable-auto-tool-choice "
                                       "--tool-call-parser hermes), or send tool_choice 'none'")


class ChatCompletionRequest(_SamplingRequest, _ToolOptions):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    tools: list[dict] | None = None  # rendered by the chat template; calls parsed with tool_choice "auto"
    tool_choice: str | dict | None = None  # "auto" (the default with tools) or "none"; others need guided decoding
    # Accepted so clients that send them work; only their "off" values are supported.
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None  # handed to the chat template (templates that read it use it)
    echo: bool | None = None  # vLLM's: refused unless false

    def check_supported(self, tool_call_parser: str | None = None) -> None:
        """``tool_call_parser``: the server's, when it serves tool_choice "auto" (else None)."""
        self.check_common()
        if not self.messages:
            raise bad_request("messages must hold at least one message", param="messages")
        if self.functions or self.function_call not in (None, "none"):
            raise unsupported("functions" if self.functions else "function_call",
                              "the legacy functions API (use tools)")
        if self.tools is not None and not all(isinstance(tool, dict) and tool.get("type") == "function"
                                              and isinstance(tool.get("function"), dict) for tool in self.tools):
            raise bad_request("every tool must be {\"type\": \"function\", \"function\": {...}}", param="tools")
        self.check_tool_choice(tool_call_parser)
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise unsupported("response_format", f"response_format {self.response_format.get('type')!r}")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", f"modalities {self.modalities!r} (only ['text'])")
        for name in ("audio", "prediction"):
            if getattr(self, name) is not None:
                raise unsupported(name, name)
        check_template_options(self)
        if self.echo:
            raise unsupported("echo", "echo on chat completions")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        # Chat's default is "as long as the context allows" (the engine clamps None to that).
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:  # the checkpoint's max_new_tokens when it names one, as vLLM
            max_tokens = defaults.get("max_tokens")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, defaults)


class CompletionRequest(_SamplingRequest):
    CHECKED_EXTRA_FIELDS: ClassVar[frozenset[str]] = frozenset({*UNSUPPORTED_VLLM_FIELDS, "response_format"})
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        self.check_common()
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be an empty list", param="prompt")
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", f"best_of={self.best_of} other than n")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo together with logprobs (it needs prompt logprobs)")
        response_format = (self.model_extra or {}).get("response_format")
        if response_format is not None and (not isinstance(response_format, dict)
                                            or response_format.get("type") != "text"):
            raise unsupported("response_format", f"response_format {response_format!r}")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs, defaults)


class TokenizeRequest(_Strict):
    """``prompt`` as completions encode it, or ``messages`` (and the chat options that change their
    rendering) exactly as chat completions render them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    tools: list[dict] | None = None



class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def template_kwargs(request: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """Variables for the chat template beyond the messages."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return kwargs


def check_reserved_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets it)",
                          param="chat_template_kwargs")


def check_template_options(request: ChatCompletionRequest | TokenizeRequest) -> None:
    """The checks vLLM makes of the options that change how messages render."""
    check_reserved_template_kwargs(request.chat_template_kwargs)
    if request.continue_final_message:
        if request.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt set to false (a new "
                              "assistant turn cannot also continue the last message)",
                              param="continue_final_message")
        if request.messages and request.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              param="continue_final_message")


# Responses API input item types that carry what this server cannot take.
_UNSUPPORTED_INPUT_PARTS = {"input_image": "images in the input", "input_file": "files in the input",
                            "input_audio": "audio in the input"}


def _joined_text(parts: list, param: str) -> str:
    """Text parts (``input_text`` / ``output_text``) joined by newlines, as chat joins them."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in _UNSUPPORTED_INPUT_PARTS:
            raise unsupported(param, _UNSUPPORTED_INPUT_PARTS[kind])
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{param} parts must be input_text or output_text with a text, got {part!r}",
                              param=param)
        texts.append(part["text"])
    return "\n".join(texts)


def _require_strings(item: dict, index: int, fields: tuple[str, ...]) -> None:
    for field in fields:
        if not isinstance(item.get(field), str):
            raise bad_request(f"input.{index}.{field} must be a string (a {item.get('type')} item), got "
                              f"{item.get(field)!r}", param=f"input.{index}.{field}")


class ResponsesRequest(_Strict, _ToolOptions):
    """``POST /v1/responses``: OpenAI's Responses API, as far as a stateless text server goes.

    ``input`` is text or a list of items: messages (``content`` text or ``input_text`` /
    ``output_text`` parts), earlier ``function_call`` items and their ``function_call_output``;
    ``reasoning`` items of earlier turns are dropped, as chat templates drop past thinking.
    Nothing is stored, so ``store`` is accepted but ``previous_response_id`` is refused.
    """

    CHECKED_EXTRA_FIELDS: ClassVar[frozenset[str]] = frozenset({*UNSUPPORTED_VLLM_FIELDS, "logit_bias", "prompt"})
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...} reaches the chat template
    text: dict[str, Any] | None = None  # {"format": {"type": "text"}} only
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    # vLLM's extras, as in chat
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self, tool_call_parser: str | None = None) -> None:
        extra = self.model_extra or {}
        for name, value in extra.items():  # as chat: asked-for vLLM features Weir lacks are refused
            if name in UNSUPPORTED_VLLM_FIELDS and not (value is None or value is False or value in ([], {})):
                raise unsupported(name, UNSUPPORTED_VLLM_FIELDS[name])
        for name, what in (("logit_bias", "logit_bias"), ("prompt", "prompt templates (prompt ids)")):
            if extra.get(name):
                raise unsupported(name, what)
        for name, what in (("previous_response_id", "previous_response_id (this server stores no responses)"),
                           ("conversation", "conversations (this server stores no responses)"),
                           ("background", "background mode"), ("top_logprobs", "logprobs on responses"),
                           ("include", "include (no extra output data is served)")):
            if getattr(self, name):
                raise unsupported(name, what)
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise bad_request(f"reasoning.effort must be a string, got {effort!r}", param="reasoning.effort")
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", f"truncation {self.truncation!r} (a prompt too long is an error)")
        text_format = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(text_format, dict):
            raise bad_request(f"text.format must be an object such as {{\"type\": \"text\"}}, got {text_format!r}",
                              param="text.format")
        if text_format.get("type") != "text":
            raise unsupported("text.format", f"text format {text_format.get('type')!r} (it needs guided decoding)")
        for index, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise unsupported(f"tools.{index}", f"the built-in tool {tool.get('type')!r}")
            if not isinstance(tool.get("name"), str):
                raise bad_request("a function tool needs a name", param=f"tools.{index}.name")
            if not isinstance(tool.get("parameters", {}), (dict, type(None))):
                raise bad_request("a function tool's parameters must be a JSON schema object",
                                  param=f"tools.{index}.parameters")
        self.check_tool_choice(tool_call_parser)
        check_reserved_template_kwargs(self.chat_template_kwargs)
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must hold at least one item", param="input")

    def template_tools(self) -> list[dict] | None:
        """The flat Responses tools in the chat form chat templates render."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                  if key in tool}} for tool in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        return kwargs

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates take it: instructions first, function calls as an
        assistant turn's ``tool_calls``, their outputs as ``tool`` turns."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for index, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(self._message(item, index))
            elif kind == "function_call":
                _require_strings(item, index, ("call_id", "name", "arguments"))
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                _require_strings(item, index, ("call_id",))
                output = item.get("output")
                content = (_joined_text(output, f"input.{index}.output") if isinstance(output, list)
                           else output)
                if not isinstance(content, str):
                    raise bad_request(f"input.{index}.output must be text or a list of input_text parts",
                                      param=f"input.{index}.output")
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
            elif kind != "reasoning":
                raise unsupported(f"input.{index}", f"input items of type {kind!r}")
        return [template_message(message, index) for index, message in enumerate(messages)]

    @staticmethod
    def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
        role, content = item.get("role"), item.get("content")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"input.{index}.role must be user, system, developer or assistant, got {role!r}",
                              param=f"input.{index}.role")
        if isinstance(content, list):
            content = _joined_text(content, f"input.{index}.content")
        elif not isinstance(content, str):
            raise bad_request(f"input.{index}.content must be text or a list of parts", param=f"input.{index}.content")
        return {"role": role, "content": content}

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        max_tokens = self.max_output_tokens if self.max_output_tokens is not None else defaults.get("max_tokens")
        return SamplingParams(max_tokens=max_tokens, **sampling_fields_with_defaults(self, defaults))
