"""What the scheduler hands the runner each step: a diff against what the runner already holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from weir.kv_cache.state_checkpoints import StateCopies
from weir.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no row for: admitted, or resumed after preemption."""

    req_id: str
    prefill_token_ids: list[int]  # prompt plus outputs so far (a resumed request recomputes them)
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]  # per paged cache group (null block where a window freed one)
    num_computed_tokens: int  # prefix-cache hit
    sampling_params: SamplingParams
    seed: int
    stop_token_ids: tuple[int, ...]  # EOS and the request's stop ids, banned while under min_tokens
    state_slot: int | None = None  # linear-attention state slot (hybrid models), zeroed on admission


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only their newly appended blocks, per paged cache group."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    # Batch order: request id -> tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose chunk reaches their last known token: the token sampled for them is real.
    sampling_req_ids: set[str]
    # Requests still owed min_tokens outputs: their stop tokens are banned this step.
    min_tokens_req_ids: set[str]
    # Rows to give back before this step runs.
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Hybrid models' prefix cache: checkpoints loaded into admitted requests' state slots before
    # the forward, and states saved into checkpoints after it (None: no copies this step).
    state_copies: StateCopies | None = None
    # Speculative decoding: request id -> drafts this step verifies (its last scheduled tokens;
    # the drafts themselves wait on the device). Requests without drafts are left out.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # The requests scheduled, by id: results are applied only to these very objects (an id can be
    # reused after an abort while this step is still in flight). Host-side; the runner ignores it.
    scheduled_requests: dict = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
