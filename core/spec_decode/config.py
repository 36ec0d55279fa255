"""``speculative_config``: what the user asks of speculative decoding, named as vLLM names it.

Given as a dict (``LLM(..., speculative_config={...})``) or a JSON object
(``--speculative-config '{"method": "ngram", ...}'``). Every key is checked; a bad value is an
error naming its field, an unknown key an error listing the known ones.

Methods: ``ngram`` (prompt lookup), ``draft_model`` (a smaller Weir model with the target's
vocabulary), ``eagle`` / ``eagle3`` (a draft head fed the target's hidden states) and ``mtp``
(the target checkpoint's own multi-token-prediction block; vLLM's ``qwen3_next_mtp`` and
``deepseek_mtp`` spell the same thing). Weir adds two keys of its own: ``adaptive`` (verify
fewer drafts for requests whose drafts are rarely accepted, ``weir.spec_decode.adaptive``) and
``verification_cost`` (what one verified draft costs, relative to a decode step, in that rule).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# vLLM's other spellings of these methods.
METHOD_ALIASES = {"[ngram]": "ngram", "qwen3_next_mtp": "mtp", "deepseek_mtp": "mtp", "eagle-3": "eagle3"}
# Methods whose drafts come from a model: they write the KV of positions past the scheduled ones.
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's default n-gram sizes when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model / eagle / eagle3 checkpoint; None for ngram and mtp
    prompt_lookup_max: int | None = None  # ngram: the longest n-gram matched
    prompt_lookup_min: int | None = None  # ngram: the shortest
    draft_tensor_parallel_size: int | None = None  # accepted as 1 only (as the target)
    disable_by_batch_size: int | None = None  # no drafts while this many requests or more run
    adaptive: bool = True
    verification_cost: float = 0.1

    @classmethod
    def from_user(cls, value: Any) -> SpeculativeConfig | None:
        """A JSON string, a dict, a ``SpeculativeConfig`` or None (no speculation)."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):  # built by hand: checked as a dict would be
            value.validate()
            return value.with_defaults()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON ({error.msg} at character {error.pos}): "
                                 f"{value!r}") from error
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(known))}")
        options = dict(value)
        method = options.get("method")
        if method is None:
            if options.get("model") is None:
                raise ValueError("speculative_config.method is required (one of " + ", ".join(METHODS) + ")")
            method = "draft_model"  # as vLLM: a draft checkpoint without a method is a draft model
        if not isinstance(method, str):
            raise ValueError(f"speculative_config.method must be a string, got {method!r}")
        options["method"] = METHOD_ALIASES.get(method, method)
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config.num_speculative_tokens is required (the drafts verified per step)")
        config = cls(**options)
        config.validate()
        return config.with_defaults()

    def with_defaults(self) -> SpeculativeConfig:
        if self.method != "ngram":
            return self
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) is larger than prompt_lookup_max ({high})")
        return _replace(self, prompt_lookup_min=low, prompt_lookup_max=high)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported; choose one of "
                             f"{', '.join(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        for name in ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 1, None)
        if self.method != "ngram":
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is an ngram option; method is {self.method!r}")
        size = self.draft_tensor_parallel_size
        if size is not None:
            _check_int("draft_tensor_parallel_size", size, 1, None)
            if size != 1:
                raise ValueError(f"speculative_config.draft_tensor_parallel_size={size}: only 1 (tensor "
                                 f"parallelism is not implemented)")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path (a string), got {self.model!r}")
        if self.method in ("draft_model", "eagle", "eagle3") and self.model is None:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}: the draft "
                             f"checkpoint's folder")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is not used by method 'ngram' (it drafts from the prompt)")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        cost = self.verification_cost
        if isinstance(cost, bool) or not isinstance(cost, numbers.Real) or not 0 <= cost <= 10:
            raise ValueError(f"speculative_config.verification_cost must be a number in [0, 10], got {cost!r}")

    @property
    def uses_draft_model(self) -> bool:
        return self.method in MODEL_METHODS

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a step's scheduled tokens that proposing writes (model drafts do)."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _replace(config: SpeculativeConfig, **changes) -> SpeculativeConfig:
    return SpeculativeConfig(**{**config.as_dict(), **changes})


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"speculative_config.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config.{name} must be {bound}, got {value}")


PER_REQUEST_METRICS_LEVELS = ("none", "summary", "detailed")
