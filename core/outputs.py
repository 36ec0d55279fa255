"""What the engine hands back to callers, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One token's log probability under the raw logits."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request, as generated so far."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token: token id -> Logprob (the sampled token plus the top k).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    # The stop string or stop token id that ended it; None for EOS, length or abort.
    stop_reason: int | str | None = None
    # Speculative decoding's acceptance counts of this completion so far
    # (weir.spec_decode.stats.RequestSpecStats; None without speculation).
    spec_decode_metrics: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions; sent once per step while streaming."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache at admission (of the first completion, as vLLM).
    num_cached_tokens: int | None = None
