"""One token budget per step and no prefill/decode phases.

Every unfinished request is owed ``num_tokens_with_placeholders - num_computed_tokens``
tokens; each step hands out ``max_num_batched_tokens`` of them, running requests first, then
waiting ones in arrival order. Chunked prefill and prefix-cache hits fall out of that one rule.
When blocks run out the newest running request is preempted by recompute. For a hybrid model
with prefix caching, a prefill chunk also ends at each boundary whose linear-attention state the
prefix cache keeps (``KVCacheManager.end_chunk_at_checkpoint``), so the state can be saved there.

With async scheduling the scheduler plans step N+1 before step N's sampled tokens reach the
host: a request whose chunk reaches its end gets an output *placeholder*, and stop conditions
are applied when the real token arrives (a token sampled meanwhile is dropped).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from weir.config import SchedulerConfig
from weir.kv_cache import KVCacheManager
from weir.request import Request, RequestStatus
from weir.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from weir.spec_decode.scheduling import SpecScheduling


@dataclass
class SampledTokens:
    """What one step produced, on the host: one entry per request in batch order.

    A step that verified drafts gives each request its emitted tokens instead
    (``spec_token_ids[b]``: the accepted drafts, then the token sampled after them), the drafts
    it verified (``num_verified_drafts``), and logprobs per emitted token
    (``logprob_token_ids[b][j]``...).
    """

    req_ids: list[str]
    sampled_token_ids: list[int] | None
    logprob_token_ids: list | None = None  # [B][1 + k] (spec: [B][S][1 + k]); column 0 = the sampled token
    logprobs: list | None = None
    logprob_ranks: list | None = None  # rank of the sampled token ([B], spec: [B][S])
    spec_token_ids: list[list[int]] | None = None
    num_verified_drafts: list[int] | None = None

    def tokens_of(self, batch_idx: int) -> list[int]:
        if self.spec_token_ids is not None:
            return self.spec_token_ids[batch_idx]
        return [self.sampled_token_ids[batch_idx]]

    def logprobs_of(self, batch_idx: int, num_top: int) -> list[tuple[list[int], list[float], int]]:
        """Per emitted token: (ids, values, rank), the sampled token first, then ``num_top`` more."""
        if self.logprobs is None:
            return []
        ids, values, ranks = (self.logprob_token_ids[batch_idx], self.logprobs[batch_idx],
                              self.logprob_ranks[batch_idx])
        end = num_top + 1
        if self.spec_token_ids is None:
            return [(ids[:end], values[:end], ranks)]
        return [(ids[j][:end], values[j][:end], ranks[j]) for j in range(len(self.spec_token_ids[batch_idx]))]


@dataclass
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]]  # per new token: ids, values, rank
    finished: bool


class _Step:
    """What one ``schedule()`` hands out, filled in request by request as each is scheduled."""

    __slots__ = ("num_scheduled", "requests", "num_drafts", "sampling", "min_tokens")

    def __init__(self):
        self.num_scheduled: dict[str, int] = {}  # batch order
        self.requests: dict[str, Request] = {}
        self.num_drafts: dict[str, int] = {}
        self.sampling: set[str] = set()
        self.min_tokens: set[str] = set()

    def add(self, request: Request, num_new: int, owed: int, speculating: bool) -> None:
        """Count ``num_new`` tokens computed for ``request``, which is ``owed`` tokens up to its
        last known one; past them, a verifying request computes its drafts."""
        request_id = request.request_id
        self.num_scheduled[request_id] = num_new
        self.requests[request_id] = request
        request.num_computed_tokens += num_new
        if num_new < owed:
            request.drafts_ready = False  # a partial prefill chunk samples nothing, so leaves no drafts
            return
        num_drafts = num_new - owed
        if num_drafts:
            self.num_drafts[request_id] = num_drafts
            request.num_unverified_drafts += num_drafts
        if len(request.output_token_ids) + request.num_output_placeholders < request.sampling_params.min_tokens:
            self.min_tokens.add(request_id)
        # As if every draft will be accepted; update() takes the rejected ones back.
        request.num_output_placeholders += 1 + num_drafts
        self.sampling.add(request_id)
        request.drafts_ready = speculating  # proposing follows every sampling step


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, spec: SpecScheduling | None = None):
        """``spec``: speculative decoding's share of scheduling (None: no drafts)."""
        self.config = config
        self.kv_cache = kv_cache
        self.spec = spec
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests that held a runner row and ended since the last schedule().
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- request lifecycle -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        # Fits by construction: prompts are shorter than max_model_len, and the runner refuses a
        # KV cache that cannot hold one max_model_len request.
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.spec is not None:
            self.spec.prepare(request)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> None:
        request = self.requests.pop(request_id, None)
        if request is None or request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._finished_req_ids.add(request_id)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason

    def abort_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_rows_to_release(self) -> bool:
        """Finished requests whose runner rows the next ``schedule()`` gives back."""
        return bool(self._finished_req_ids)

    def release_rows(self, request_ids) -> None:
        """Have the next ``schedule()`` tell the runner to drop these requests' rows: after a
        failed step, whose output (the only message that carried its releases) never arrived."""
        self._finished_req_ids.update(request_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling --------------------------------------------------------------------

    def _preempt(self, request: Request, preempted: set[str]) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.drafts_ready = False  # the row, and the drafts in it, go
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        preempted.add(request.request_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        spec, kv_cache, running = self.spec, self.kv_cache, self.running
        step = _Step()
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()

        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            # Tokens it can compute now: none while it waits for its final outputs. (Read from
            # the fields, not the properties: this runs for every running request every step.)
            num_outputs = len(request.output_token_ids) + request.num_output_placeholders
            owed = (0 if num_outputs >= request.max_tokens
                    else len(request.prompt_token_ids) + num_outputs - num_computed)
            drafts = spec.num_drafts(request, owed, len(running)) if spec is not None else 0
            num_new = min(owed + drafts, budget)
            if num_new <= 0:
                kv_cache.free_out_of_window(request)
                index += 1
                continue
            num_new = kv_cache.end_chunk_at_checkpoint(request, num_computed, num_new)
            lookahead = spec.lookahead(request, num_computed, num_new) if spec is not None else 0
            new_blocks = kv_cache.allocate_slots(request, num_new + lookahead)
            while new_blocks is None:
                victim = running[-1]  # later in the list, so not scheduled yet this step
                self._preempt(victim, preempted)
                if victim is request:
                    break
                new_blocks = kv_cache.allocate_slots(request, num_new + lookahead)
            if new_blocks is None:
                break
            step.add(request, num_new, owed, spec is not None)
            if any(new_blocks):  # a decode step mostly fits its last blocks: nothing to tell the runner
                cached.req_ids.append(request.request_id)
                cached.new_block_ids.append(new_blocks)
            budget -= num_new
            index += 1

        while (self.waiting and budget > 0 and not preempted
               and len(running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_output_placeholders > 0:
                break  # its last token is still on the way; resume it once it has arrived
            hit_blocks, num_hit_tokens = kv_cache.get_computed_blocks(request)
            owed = request.num_tokens - num_hit_tokens
            num_new = kv_cache.end_chunk_at_checkpoint(request, num_hit_tokens, min(owed, budget))
            lookahead = spec.lookahead(request, num_hit_tokens, num_new) if spec is not None else 0
            if kv_cache.allocate_slots(request, num_new + lookahead, hit_blocks) is None:
                break
            kv_cache.count_admission(request, num_hit_tokens)
            self.waiting.popleft()
            running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens is None:  # a preempted request's re-admission does not count
                request.num_cached_tokens = num_hit_tokens
            new_reqs.append(self._new_request_data(request))
            step.add(request, num_new, owed, spec is not None)
            budget -= num_new

        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            new_reqs=new_reqs, cached_reqs=cached, num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget, sampling_req_ids=step.sampling,
            min_tokens_req_ids=step.min_tokens, finished_req_ids=finished - preempted if preempted else finished,
            preempted_req_ids=preempted, state_copies=self.kv_cache.take_state_copies(),
            scheduled_requests=step.requests, num_draft_tokens=step.num_drafts,
        )

    def _new_request_data(self, request: Request) -> NewRequestData:
        params = request.sampling_params
        return NewRequestData(
            req_id=request.request_id, prefill_token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens, block_ids=self.kv_cache.block_ids(request),
            num_computed_tokens=request.num_computed_tokens, sampling_params=params, seed=request.seed,
            stop_token_ids=tuple(request.eos_token_ids) + tuple(params.stop_token_ids),
            state_slot=request.state_slot,
        )

    # ---- results -----------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: SampledTokens) -> list[RequestUpdate]:
        """Apply one step's sampled tokens: append them and check the stop conditions."""
        updates = []
        requests, spec = self.requests, self.spec
        sampling, scheduled, drafts_of = output.sampling_req_ids, output.scheduled_requests, output.num_draft_tokens
        max_model_len = self.config.max_model_len
        for batch_idx, request_id in enumerate(sampled.req_ids):
            if request_id not in sampling:
                continue  # a partial prefill chunk: its sample is not a real token
            request = requests.get(request_id)
            if request is None or request is not scheduled.get(request_id):
                continue  # finished or aborted while this step ran: the token is dropped
            num_drafts = drafts_of.get(request_id, 0) if drafts_of else 0
            request.num_output_placeholders -= 1 + num_drafts
            request.num_unverified_drafts -= num_drafts
            token_ids = sampled.tokens_of(batch_idx)
            if spec is not None:  # a step without drafts counts too: the adaptive rule decays
                num_verified = sampled.num_verified_drafts[batch_idx] if sampled.num_verified_drafts else 0
                spec.apply_result(request, num_drafts, num_verified, len(token_ids) - 1)
            params = request.sampling_params
            status = stop_reason = None
            output_ids = request.output_token_ids
            num_prompt = len(request.prompt_token_ids)
            for count, token_id in enumerate(token_ids, start=1):  # tokens past a stop are dropped
                output_ids.append(token_id)
                num_outputs = len(output_ids)
                if num_outputs >= params.min_tokens:
                    if token_id in request.eos_token_ids:
                        status = RequestStatus.FINISHED_STOPPED
                    elif token_id in params.stop_token_ids:
                        status, stop_reason = RequestStatus.FINISHED_STOPPED, token_id
                if status is None and (num_outputs >= request.max_tokens or num_prompt + num_outputs >= max_model_len):
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    self.finish_request(request_id, status, stop_reason)
                    if count < len(token_ids):
                        token_ids = token_ids[:count]
                    break
            logprobs = []
            if params.logprobs is not None:
                logprobs = sampled.logprobs_of(batch_idx, params.logprobs)
                if len(logprobs) > len(token_ids):  # cut at a stop
                    logprobs = logprobs[: len(token_ids)]
            updates.append(RequestUpdate(request, token_ids, logprobs, status is not None))
        return updates
