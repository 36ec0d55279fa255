"""A request as the scheduler sees it: token ids, progress, blocks, and why it finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from weir.kv_cache.block_pool import ROOT_HASH, hash_block
from weir.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str):
        # A plain attribute, not a property: read for every request every step.
        self.is_finished = value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # empty when the request ignores EOS
    max_tokens: int  # resolved against the context: never runs past max_model_len
    seed: int  # every request has one; unseeded requests get one from the engine's RNG
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    # Prompt tokens the prefix cache held when the request was first admitted (None until then).
    num_cached_tokens: int | None = None
    # Tokens sampled on the device that the host has not seen yet (async scheduling).
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    # Chained hashes of the full blocks of known tokens (the KV manager holds the blocks themselves).
    block_hashes: list[bytes] = field(default_factory=list)
    state_slot: int | None = None  # linear-attention state slot while running (hybrid models)
    # Speculative decoding (weir.spec_decode): drafts wait on the device for this request's next
    # step (its last step sampled, and proposing followed); how many drafts its steps verify;
    # its acceptance counts (None without speculation).
    drafts_ready: bool = False
    # Drafts scheduled whose verification has not reached the host (async scheduling): counted
    # in num_computed_tokens as if accepted, though the device may reject every one.
    num_unverified_drafts: int = 0
    adaptive: Any = None  # weir.spec_decode.adaptive.AdaptiveDrafts
    spec_stats: Any = None  # weir.spec_decode.stats.RequestSpecStats

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_surely_computed_tokens(self) -> int:
        """``num_computed_tokens`` less the drafts still being verified: where the request's next
        query may start on the device, so what its sliding windows must still cover."""
        return max(0, self.num_computed_tokens - self.num_unverified_drafts)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_outputs_with_placeholders(self) -> int:
        return len(self.output_token_ids) + self.num_output_placeholders

    def update_block_hashes(self, block_size: int) -> list[bytes]:
        """Extend the chained hashes to every full block of known tokens."""
        hashes, prompt, output = self.block_hashes, self.prompt_token_ids, self.output_token_ids
        num_prompt = len(prompt)
        num_full_blocks = (num_prompt + len(output)) // block_size
        while len(hashes) < num_full_blocks:
            start = len(hashes) * block_size
            end = start + block_size
            tokens = prompt[start:end] + output[max(0, start - num_prompt):max(0, end - num_prompt)]
            hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, tokens))
        return hashes
