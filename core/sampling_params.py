"""Per-request sampling parameters, with OpenAI / vLLM names, defaults and ranges.

Every field is checked when the object is built (and again by ``clone``), so a bad request fails
at admission with a ValueError that names the field, never deep inside the sampler.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

GREEDY_BELOW_TEMPERATURE = 1e-5  # a positive temperature under this samples greedily


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `n=True` is a caller bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: object) -> float:
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_int(name: str, value: object) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to sample the completion of one request.

    ``temperature=0`` (or under 1e-5, or ``top_k=1``) is greedy decoding. ``top_k`` 0 or -1 means
    no top-k (-1 is normalised to 0). ``max_tokens=None`` means up to the context length. ``stop`` is
    normalised to a list. ``logprobs=k`` returns the sampled token's logprob plus the top k.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # As vLLM: the text leaves out the stop string or stop token that ended it, unless this is set.
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_sampling()
        self._check_penalties()
        self._check_stops()
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)

    def _check_counts(self) -> None:
        if _check_int("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None and _check_int("logprobs", self.logprobs) < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if self.seed is not None and _check_int("seed", self.seed) == -1:
            self.seed = None  # vLLM's spelling of "no seed"

    def _check_sampling(self) -> None:
        self.temperature = _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature:g}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            # The limit is greedy anyway, and logits divided by a denormal float32 overflow to
            # inf, after which sampling picks token 0. vLLM draws the line at the same place.
            self.temperature = 0.0
        self.top_p = _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        if _check_int("top_k", self.top_k) == -1:
            self.top_k = 0  # -1 is the OpenAI-style spelling of "no top-k"
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (or -1 for off), got {self.top_k}")
        self.min_p = _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value:g}")
            setattr(self, name, value)
        self.repetition_penalty = _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty:g}")

    def _check_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
        for stop_string in self.stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise ValueError(f"stop entries must be non-empty strings, got {stop_string!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids entries must be ints >= 0, got {token_id!r}")

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy with ``changes`` applied; lists are copied, never shared."""
        copied_lists = {"stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids)}
        return dataclasses.replace(self, **{**copied_lists, **changes})

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this request's token counts at all."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
