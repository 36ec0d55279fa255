"""``weir.LLM``: offline batched generation, shaped like ``vllm.LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from weir.engine import LLMEngine
from weir.outputs import RequestOutput
from weir.process import set_step_loop_gc_thresholds
from weir.sampling_params import SamplingParams
from weir.tokenizer import encode_rendered_chat, render_chat_template, template_message


class LLM:
    """``LLM(model, **engine_options)``: model is a checkpoint folder or .gguf file (None: the
    built-in default model); options are ``weir.config.EngineArgs`` fields, named as vLLM names them."""

    def __init__(self, model: str | None = None, **engine_options):
        set_step_loop_gc_thresholds()  # an entry point: the program's settings are set here
        self.engine = LLMEngine.from_options(model, **engine_options)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        """The transformers tokenizer; a ValueError under ``skip_tokenizer_init`` (as vLLM)."""
        from weir.no_tokenizer import has_tokenizer, tokenizer_required_message

        if not has_tokenizer(self.engine.tokenizer):
            raise ValueError(tokenizer_required_message("get_tokenizer() needs"))
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts: a string, a ``{"prompt_token_ids": [...]}`` dict, a list of token ids, or a list
        of any of these. Returns one ``RequestOutput`` per prompt, in order."""
        prompts = _prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._request_counter))
                self.engine.add_request(request_id, prompt, params, final_only=True)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            # The step that raised may have left blocks registered but never written. The call
            # fails as a whole, so the requests the reset spared (still waiting) go too.
            self.engine.reset_after_failure()
            self.engine.abort_request(request_ids)
            self._drain()
            raise

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` messages, content a string or OpenAI
        text parts) or a list of them, rendered by the chat template as ``vllm.LLM.chat`` renders
        them; each output's ``prompt`` is the rendered text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = chat_template or self.engine.model_config.chat_template
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            prepared = [template_message(message, index) for index, message in enumerate(conversation)]
            text = render_chat_template(tokenizer, prepared, template, add_generation_prompt,
                                        continue_final_message, chat_template_kwargs, tools)
            prompts.append({"prompt": text, "prompt_token_ids": encode_rendered_chat(tokenizer, text)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """``LLMEngine.default_sampling_params`` under vLLM's name (a fresh copy, free to change)."""
        return self.engine.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests run. As vLLM's."""
        return self.engine.reset_prefix_cache()

    @property
    def llm_engine(self) -> LLMEngine:
        """``engine`` under vLLM's name."""
        return self.engine

    @staticmethod
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams | None]:
        if sampling_params is None:  # the engine's defaults: the checkpoint's generation_config values
            return [None] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts")
        return list(sampling_params)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req") as progress:
            while len(finished) < len(wanted):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.update(1)
        self._drain()
        return [finished[request_id] for request_id in request_ids]

    def _drain(self) -> None:
        """Finish the step still in flight, so no request outlives the call that made it."""
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _is_token_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in value)


def _prompt_list(prompts) -> list:
    """As vLLM: one prompt (text, a dict, or token ids) or a list of them."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        prompts = [prompts]
    return [{"prompt_token_ids": list(prompt)} if _is_token_ids(prompt) else prompt for prompt in prompts]
