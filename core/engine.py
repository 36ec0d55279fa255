"""The engine: validates and tokenizes requests, drives schedule -> execute -> update, and
turns sampled tokens into text.

With async scheduling one step stays in flight: the engine launches step N+1 before it reads
step N's tokens back, so the host's work overlaps the device's.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from weir.config import EngineArgs, EngineConfig
from weir.detokenizer import IncrementalDetokenizer, decode_token
from weir.kv_cache import KVCacheManager
from weir.kv_cache.retention import describe_retention
from weir.no_tokenizer import TokenIdsOnly, has_tokenizer, tokenizer_required_message
from weir.outputs import CompletionOutput, Logprob, RequestOutput
from weir.request import Request, RequestStatus
from weir.runner.model_runner import ModelRunner
from weir.sampling_params import SamplingParams
from weir.scheduler import Scheduler
from weir.scheduler.scheduler import RequestUpdate
from weir.selection import backend_names
from weir.spec_decode.scheduling import SpecScheduling
from weir.tokenizer import encode_prompt, start_loading_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Child:
    """One of a request's ``n`` completions: its own scheduler request and detokenizer."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | TokenIdsOnly
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    final_only: bool = False  # report this request once, when it finishes
    children: list[_Child] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        for child in self.children:  # a loop, not all() over a generator: read for every request every step
            if not child.request.is_finished:
                return False
        return True

    def output(self, finished: bool) -> RequestOutput:
        """``finished``: ``self.finished``, which the caller has read already."""
        completions = []
        for child in self.children:
            request = child.request
            done = request.is_finished
            completions.append(CompletionOutput(
                index=child.index, text=child.detokenizer.visible_text(done),
                token_ids=list(request.output_token_ids), cumulative_logprob=child.cumulative_logprob,
                logprobs=child.logprobs, finish_reason=request.status.value if done else None,
                stop_reason=request.stop_reason,
                spec_decode_metrics=(None if request.spec_stats is None
                                     else request.spec_stats.copy(with_steps=done)),
            ))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished,
                             self.children[0].request.num_cached_tokens)


class LLMEngine:
    def __init__(self, config: EngineConfig, platform, model_cls: type,
                 choose_attention_backends: Callable[[set[str]], dict[str, type]],
                 choose_moe_backend: Callable[[], type], resolve_model: Callable[[str], type] | None = None):
        """The choosers run once the model is built: ``choose_attention_backends(layer_kinds) ->
        {kind: backend class}`` (``PluginRegistry.select_attention_backends``), and
        ``choose_moe_backend()`` only for models with MoE layers."""
        self.config = config
        self.platform = platform
        self.model_config = config.model
        # The tokenizer loads in a thread beside the model's load and warm-up (both need only the config).
        with ThreadPoolExecutor(1, thread_name_prefix="weir-tokenizer") as pool:
            tokenizer = start_loading_tokenizer(config.model, pool)
            self.runner = ModelRunner(config, platform, model_cls, choose_attention_backends, choose_moe_backend,
                                      resolve_model)
            self.tokenizer = tokenizer.result()
        prefix_caching = self._prefix_caching_switch()
        kv_cache = KVCacheManager(config.cache.block_size, self.runner.kv_group_configs(), prefix_caching,
                                  num_state_slots=self.runner.num_state_slots,
                                  num_checkpoint_slots=self.runner.num_checkpoint_slots if prefix_caching else 0,
                                  retention_interval=config.cache.prefix_cache_retention_interval)
        spec = None
        if config.speculative is not None:
            spec = SpecScheduling(config.speculative, config.scheduler.max_model_len,
                                  detailed_stats=config.per_request_spec_decode_metrics == "detailed")
        self.scheduler = Scheduler(config.scheduler, kv_cache, spec)
        self._rng = random.Random(config.seed)
        self._busy = False  # whether the last step left work behind (see step: the idle check)
        self._in_flight: deque = deque()
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token by token id

    def _prefix_caching_switch(self) -> bool:
        """Whether prefix caching is on, said in the start-up log with the retention rule where
        it matters (windowed groups, linear-attention state checkpoints)."""
        config, runner = self.config, self.runner
        if not config.cache.enable_prefix_caching:
            logger.info("prefix caching: off")
            return False
        retention = describe_retention(config.cache.prefix_cache_retention_interval)
        if runner.caches.state_layers:
            if runner.num_checkpoint_slots == 0:
                # A recurrent state cannot be rebuilt from cached KV blocks: without checkpoints no hit can resume.
                logger.warning("prefix caching: off for %s: the KV cache budget leaves no room for one "
                               "linear-attention state checkpoint (%.1f MiB); raise kv_cache_memory_bytes or "
                               "gpu_memory_utilization", config.model.architecture,
                               runner.linear_state.bytes_per_slot / 2**20)
                return False
            logger.info("prefix caching: on for %s (hybrid): its linear-attention layers resume from state "
                        "checkpoints (%d slots); %s", config.model.architecture, runner.num_checkpoint_slots, retention)
        elif any(group.sliding_window is not None for group in runner.caches.groups):
            logger.info("prefix caching: on; windowed groups keep cached window blocks by the %s", retention)
        else:
            logger.info("prefix caching: on")
        return True

    @classmethod
    def from_options(cls, model: str | None = None, *, on_config: Callable[[EngineConfig], None] | None = None,
                     **options) -> "LLMEngine":
        """``on_config(config)`` runs once the config is made, before the model loads (the engine
        process sends it ahead, so the server loads its tokenizer meanwhile)."""
        from weir.plugin_manager import load_plugins

        start = time.perf_counter()
        args = EngineArgs.from_options(model, **options)
        registry = load_plugins()
        # Checked here, not when chosen: a model without MoE layers never asks for its backend,
        # and a misspelt name would otherwise pass unnoticed.
        requested = {"attention_backend": (backend_names(args.attention_backend), registry.attention_backends),
                     "moe_backend": ([args.moe_backend] if args.moe_backend else [], registry.moe_backends)}
        for option, (names, table) in requested.items():
            for name in names:
                if name not in table:
                    raise ValueError(f"{option} {name!r} is not registered; known: {', '.join(sorted(table))}"
                                     f"{registry.restriction_note()}")
        platform = registry.select_platform(args.device)
        wait_for_device = platform.start_device_setup()
        platform_seconds = time.perf_counter() - start
        try:
            config = args.create_config(platform.device_type)
            model_cls = registry.resolve_model(config.model.architecture)
            logger.info("model %s (%s) on %s (plugins and platform %.1f s, config %.1f s)", config.model.model,
                        config.model.architecture, platform.name, platform_seconds,
                        time.perf_counter() - start - platform_seconds)
        finally:  # also on a bad config: no set-up thread may outlive a failed start
            wait_for_device()
        if on_config is not None:
            on_config(config)

        def choose_attention_backends(layer_kinds: set[str]) -> dict[str, type]:
            return registry.select_attention_backends(platform, layer_kinds, args.attention_backend)

        def choose_moe_backend() -> type:
            return registry.select_moe_backend(platform, args.moe_backend)

        return cls(config, platform, model_cls, choose_attention_backends, choose_moe_backend, registry.resolve_model)

    # ---- requests ----------------------------------------------------------------------

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt is a string, or a dict with ``prompt_token_ids`` (or ``prompt``)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(token_ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        return prompt, encode_prompt(self.tokenizer, prompt)

    def default_sampling_params(self) -> SamplingParams:
        """What a request without parameters samples with: as vLLM, the checkpoint's
        generation_config values over SamplingParams' defaults (a fresh copy)."""
        return SamplingParams(**dict(self.model_config.sampling_defaults))

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    final_only: bool = False) -> None:
        """Queue a request. ``final_only``: ``step()`` reports it only once it has finished (what
        offline generation needs; building every step's cumulative output is host work)."""
        params = params or self.default_sampling_params()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{index}" for index in range(params.n)]
        taken = [i for i in [request_id, *child_ids] if i in self._parents or i in self._child_of]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        self._validate(prompt_token_ids, params)
        max_model_len = self.config.scheduler.max_model_len
        room = max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        parent = _Parent(request_id, prompt_text, prompt_token_ids, final_only)
        for index, child_id in enumerate(child_ids):
            seed = self._rng.getrandbits(63) if params.seed is None else params.seed + index
            request = Request(child_id, list(prompt_token_ids), params, eos, max_tokens, seed)
            want_logprobs = params.logprobs is not None
            child = _Child(index, request, self._detokenizer(prompt_token_ids, params),
                           [] if want_logprobs else None, 0.0 if want_logprobs else None)
            parent.children.append(child)
        for child in parent.children:
            self.scheduler.add_request(child.request)
            self._child_of[child.request.request_id] = (parent, child)
        self._parents[request_id] = parent

    def _detokenizer(self, prompt_token_ids: list[int],
                     params: SamplingParams) -> IncrementalDetokenizer | TokenIdsOnly:
        if not has_tokenizer(self.tokenizer):  # skip_tokenizer_init: token ids out, no text
            return TokenIdsOnly()
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        max_model_len = self.config.scheduler.max_model_len
        if params.stop and not has_tokenizer(self.tokenizer):
            raise ValueError(tokenizer_required_message("stop (stop strings) needs"))
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is "
                             f"{max_model_len}: it must be shorter to leave room for output")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than max_logprobs={self.config.max_logprobs}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids entry {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                self._child_of.pop(child.request.request_id, None)
                self.scheduler.finish_request(child.request.request_id, RequestStatus.FINISHED_ABORTED)

    def reset_after_failure(self) -> list[str]:
        """After a step raised: drop the steps in flight and abort every request that has run,
        so the next steps start from a consistent state (their rows and blocks are freed as
        usual). Returns the aborted request ids.

        Requests that never ran (every child still waiting for its first step) hold no blocks,
        runner row or state slot, and no failed step touched them: they keep their place. Any
        that has run, preempted ones too, is aborted: it may have been in the failed step, and
        its tokens in flight were dropped with it.
        """
        self._in_flight.clear()
        never_ran = {request.request_id for request in self.scheduler.waiting
                     if request.status == RequestStatus.WAITING}  # preempted ones are PREEMPTED
        failed = [request_id for request_id, parent in self._parents.items()
                  if any(child.request.request_id not in never_ran for child in parent.children)]
        self.abort_request(failed)
        # The failed step's output was the only message carrying its row releases (requests
        # finished or preempted just before it); rows of requests not running now are stale.
        running = {request.request_id for request in self.scheduler.running}
        self.scheduler.release_rows(self.runner.request_ids_with_rows() - running)
        # Blocks were registered in the prefix cache when scheduled; the failed step may never
        # have written their KV.
        self.scheduler.kv_cache.reset_prefix_cache()
        return failed

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (block hashes and state checkpoints), as vLLM's
        ``reset_prefix_cache``: only while no request runs (blocks in use would stay cached), so
        False, with nothing done, otherwise."""
        if self.has_unfinished_requests():
            return False
        self.scheduler.kv_cache.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request, step in flight, or runner row still needs a step."""
        return bool(self._parents) or bool(self._in_flight) or self.scheduler.has_rows_to_release()

    # ---- the step loop -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the current state of every request that changed."""
        scheduler_output = self.scheduler.schedule()
        handle = self.runner.execute(scheduler_output)
        if handle is not None:
            self._in_flight.append((scheduler_output, handle))
        keep_in_flight = 1 if (self.config.scheduler.async_scheduling and handle is not None) else 0
        changed: dict[str, _Parent] = {}
        while len(self._in_flight) > keep_in_flight:
            done_output, done_handle = self._in_flight.popleft()
            for update in self.scheduler.update(done_output, done_handle.get()):
                parent = self._apply_update(update)
                if parent is not None:
                    changed[parent.request_id] = parent
        outputs, done = [], []
        for parent in changed.values():
            finished = parent.finished
            if finished:
                done.append(parent)
            if finished or not parent.final_only:
                outputs.append(parent.output(finished))
        busy = self.has_unfinished_requests()
        if self._busy and not busy:
            # The engine just went idle: every block and slot must be back.
            self.scheduler.kv_cache.check_idle()
        self._busy = busy
        # Finished requests are forgotten only once every output is built: had building one
        # raised, reset_after_failure still finds them all, so their callers hear of it.
        for parent in done:
            if self._parents.get(parent.request_id) is parent:
                del self._parents[parent.request_id]
                for child in parent.children:
                    self._child_of.pop(child.request.request_id, None)
        return outputs

    def _decoded_token(self, token_id: int) -> str | None:
        # Decoded once per engine: alone, a token reads the same every time, and logprobs ask
        # for 1 + k of them per token.
        text = self._token_texts.get(token_id)
        if text is None and has_tokenizer(self.tokenizer):
            text = self._token_texts[token_id] = decode_token(self.tokenizer, token_id)
        return text

    def _apply_update(self, update: RequestUpdate) -> _Parent | None:
        request = update.request
        entry = self._child_of.get(request.request_id)
        if entry is None:
            return None  # aborted meanwhile
        parent, child = entry
        detokenizer = child.detokenizer
        new_ids, new_logprobs = update.new_token_ids, update.new_logprobs  # rebound below, never changed
        # As vLLM: the EOS or stop token that ended the completion stays in token_ids, not in the text.
        hide_last = (update.finished and request.status == RequestStatus.FINISHED_STOPPED
                     and not isinstance(request.stop_reason, str) and bool(new_ids)
                     and not request.sampling_params.include_stop_str_in_output)
        stop = None
        # Several tokens arrive at once under speculative decoding: a stop string completed by
        # one of them drops the ones after it (the scheduler's stop token among them).
        for count, token_id in enumerate(new_ids[:-1] if hide_last else new_ids, start=1):
            detokenizer.append(token_id)
            stop = detokenizer.stop_string_hit
            if stop is not None:
                dropped = len(new_ids) - count
                if dropped:
                    del request.output_token_ids[-dropped:]
                    new_ids, new_logprobs, hide_last = new_ids[:count], new_logprobs[:count], False
                break
        if stop is not None:
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
            else:
                # Stopped for length (or on a token after it): the stop string came first, so it is a stop.
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if request.is_finished:
            # A character the last tokens left unfinished still shows.
            output_ids = request.output_token_ids
            detokenizer.finish(output_ids[:-1] if hide_last else output_ids)
            late_stop = detokenizer.stop_string_hit  # completed by the text finish() released
            if stop is None and late_stop is not None and request.status == RequestStatus.FINISHED_LENGTH:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, late_stop
        for ids, values, rank in new_logprobs:
            entry_logprobs = {}
            for position, (token_id, value) in enumerate(zip(ids, values)):
                if token_id in entry_logprobs:
                    continue
                entry_logprobs[token_id] = Logprob(value, rank if position == 0 else position,
                                                   self._decoded_token(token_id))
            child.logprobs.append(entry_logprobs)
            child.cumulative_logprob += values[0]
        return parent
