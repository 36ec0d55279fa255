"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), validated by pydantic.

Strict types: ``"0.5"`` is not a temperature and ``1`` is not ``true``, as with OpenAI. Fields
this server does not know are ignored (as vLLM does) and logged; known fields whose feature is
not supported (tools, logit_bias, ...) are answered with a 400 naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from weir.sampling_params import SamplingParams
from weir.server.errors import bad_request, unsupported

# OpenAI's limit: each choice is a sequence the engine schedules, so one request must not be able
# to queue an unbounded number of them ahead of everyone else.
MAX_N = 128


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self, index: int) -> dict[str, Any]:
        """``{"role", "content"}`` with text parts joined; other part types are refused."""
        if isinstance(self.content, list):
            texts = []
            for part_index, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise unsupported(f"messages.{index}.content.{part_index}.type",
                                      f"content part type {part.type!r} (only 'text')")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = self.content or ""
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class _SamplingRequest(_Strict):
    """Fields shared by chat and completions, with vLLM's extras."""

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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_common(self) -> None:
        if self.n > MAX_N:
            raise bad_request(f"n must be <= {MAX_N}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or [], logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            **{name: value for name, value in optional.items() if value is not None},
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Accepted so clients that send them work; only their "off" values are supported.
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
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
    reasoning_effort: str | None = None

    def check_supported(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request("messages must hold at least one message", param="messages")
        if self.tools or self.functions:
            raise unsupported("tools" if self.tools else "functions", "tool calling")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise unsupported(name, f"{name}={getattr(self, name)!r}")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise unsupported("response_format", f"response_format {self.response_format.get('type')!r}")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", f"modalities {self.modalities!r} (only ['text'])")
        for name in ("audio", "prediction"):
            if getattr(self, name) is not None:
                raise unsupported(name, name)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")

    def to_sampling_params(self) -> SamplingParams:
        # Chat's default is "as long as the context allows" (the engine clamps None to that).
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class CompletionRequest(_SamplingRequest):
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

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
