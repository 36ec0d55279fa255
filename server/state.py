"""What the request handlers share: the engine, settings, admission control and metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from weir import __version__
from weir.server.admission import AdmissionControl
from weir.server.errors import APIError, bad_request, from_value_error
from weir.server.generation import Generation
from weir.server.logprobs import TokenBytes
from weir.server.metrics import ServerMetrics
from weir.server.settings import ServerSettings
from weir.streams import EngineClient, EngineDeadError
from weir.tokenizer import apply_chat_template, encode_prompt

@dataclass
class ServerState:
    engine: EngineClient  # weir.async_engine.AsyncLLMEngine or weir.multiproc.ProcessEngine
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.admission = AdmissionControl(self.settings.max_num_queued_reqs, self.settings.max_num_queued_tokens)
        config = self.engine.config
        self.served_model_name = config.model.served_model_name
        self.max_model_len = config.scheduler.max_model_len
        self.chat_template = config.model.chat_template
        self.sampling_defaults = dict(config.model.sampling_defaults)
        # none, summary or detailed: what responses report of speculative decoding's acceptance.
        self.spec_metrics_level = config.per_request_spec_decode_metrics if config.speculative else "none"
        self.tokenizer = self.engine.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer)
        self.version = __version__
        self.system_fingerprint = f"fp_weir_{__version__}"
        # Tokenizing and rendering chat templates run here, not on the event loop: a prompt of
        # megabytes takes seconds (fast tokenizers release the GIL meanwhile), and the loop must
        # keep streaming everyone else's tokens. Two threads, so one huge prompt does not hold
        # up every other request's tokenizing; fast tokenizers encode concurrently (the engine
        # thread already decodes beside them).
        self._tokenizer_pool = ThreadPoolExecutor(2, thread_name_prefix="weir-tokenize")

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'", param="model", code="model_not_found")

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, template_kwargs: dict | None = None,
                          tools: list[dict] | None = None, param: str = "messages") -> list[int]:
        """The prompt's token ids; errors are 400s naming ``param`` (the request's field)."""
        try:
            return await self._off_loop(apply_chat_template, self.tokenizer, messages, self.chat_template,
                                        add_generation_prompt, continue_final_message, template_kwargs, tools)
        except ValueError as error:
            raise bad_request(str(error), param=param) from error
        except Exception as error:  # a Jinja error names what in the template broke
            raise bad_request(f"the chat template cannot render these messages: {error}",
                              param=param) from error

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            if add_special_tokens:
                return await self._off_loop(encode_prompt, self.tokenizer, text)
            return await self._off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, ValueError) as error:  # text the tokenizer refuses, e.g. a lone UTF-16 surrogate
            raise bad_request(f"the prompt cannot be tokenized: {error}", param="prompt") from error

    def decode(self, token_ids: list[int]) -> str:
        vocab_size = self.engine.config.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
        try:
            return self.tokenizer.decode(token_ids)
        except ValueError as error:  # no tokenizer (skip_tokenizer_init)
            raise bad_request(str(error), param="tokens") from error

    async def start(self, prompt_token_ids: list[int], prompt_text: str | None, params,
                    request_id: str, param: str, max_tokens_param: str | None = None) -> Generation:
        """Admit one prompt and hand it to the engine: 503 over the limits, 400 for a prompt
        the engine refuses (too long for the context, ...), naming ``param``. A ``max_tokens``
        the request set itself (``max_tokens_param`` names its field) must fit beside the prompt:
        as vLLM, that is a 400 rather than a completion quietly cut short."""
        self._check_context(len(prompt_token_ids), params.max_tokens, max_tokens_param, param)
        ticket = self.admission.admit(len(prompt_token_ids))
        record = self.metrics.new_request(len(prompt_token_ids))
        try:
            prompt = {"prompt_token_ids": prompt_token_ids, "prompt": prompt_text}
            stream = await self.engine.add_request(request_id, prompt, params)
        except ValueError as error:
            ticket.release()
            raise from_value_error(error, default_param=param) from error
        except EngineDeadError as error:
            ticket.release()
            raise APIError(503, f"the engine is not serving: {error}", code="engine_unavailable") from error
        except BaseException:
            ticket.release()
            raise
        return Generation(stream, ticket, record, self.metrics)

    def _check_context(self, num_prompt_tokens: int, max_tokens: int | None, max_tokens_param: str | None,
                       param: str) -> None:
        """Before admission: a prompt that cannot fit must not count as queued work meanwhile
        (others would get 503s for tokens that never run)."""
        if num_prompt_tokens >= self.max_model_len:
            raise bad_request(f"the prompt has {num_prompt_tokens} tokens, but max_model_len is "
                              f"{self.max_model_len}: it must be shorter to leave room for output",
                              param=param, code="context_length_exceeded")
        if max_tokens_param is None or max_tokens is None:
            return
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"'{max_tokens_param}' is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                f"({max_tokens} > {self.max_model_len} - {num_prompt_tokens})",
                param=max_tokens_param, code="context_length_exceeded")

    async def start_all(self, prompts: list[tuple[list[int], str | None]], params, base_id: str,
                        param: str, max_tokens_param: str | None = None) -> list[Generation]:
        """``start`` each prompt; if one fails, the ones already started are aborted."""
        for token_ids, _ in prompts:  # before any starts: nothing to abort on this error
            self._check_context(len(token_ids), params.max_tokens, max_tokens_param, param)
        generations: list[Generation] = []
        try:
            for index, (token_ids, text) in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
                generations.append(await self.start(token_ids, text, params, request_id, param))  # checked above
        except BaseException:
            for generation in generations:
                generation.close()
            raise
        return generations


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
