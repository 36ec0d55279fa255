"""The scheduler alone, with a fake KV manager: one token budget, running requests first,
chunked prefill, admission limits, preemption of the newest, async placeholders, and stop rules."""

from __future__ import annotations

from weir.config import SchedulerConfig
from weir.request import Request, RequestStatus
from weir.sampling_params import SamplingParams
from weir.scheduler import Scheduler
from weir.scheduler.scheduler import SampledTokens


class FakeKVCache:
    """Counts tokens instead of blocks: a request holds as many as it has scheduled, up to
    ``capacity`` across all requests. Records every call the scheduler makes."""

    def __init__(self, capacity: int = 10_000):
        self.capacity = capacity
        self.held: dict[str, int] = {}
        self.freed: list[str] = []
        self.window_frees: list[str] = []  # requests served nothing in a step (async placeholders)

    def get_computed_blocks(self, request):
        return ([],), 0

    def count_admission(self, request, num_hit_tokens):
        pass

    def allocate_slots(self, request, num_new_tokens, computed_blocks=None):
        needed = request.num_computed_tokens + num_new_tokens
        extra = needed - self.held.get(request.request_id, 0)
        if sum(self.held.values()) + max(extra, 0) > self.capacity:
            return None
        self.held[request.request_id] = max(needed, self.held.get(request.request_id, 0))
        return ([0] * max(extra, 0),)  # a block per token the request holds more

    def free(self, request):
        if self.held.pop(request.request_id, None) is not None:
            self.freed.append(request.request_id)

    def free_out_of_window(self, request):
        self.window_frees.append(request.request_id)

    def block_ids(self, request):
        return ([],)

    def end_chunk_at_checkpoint(self, request, start, num_new):
        return num_new  # no linear-attention state to checkpoint

    def take_state_copies(self):
        return None


def make_scheduler(budget: int = 16, max_num_seqs: int = 4, capacity: int = 10_000,
                   async_scheduling: bool = False) -> tuple[Scheduler, FakeKVCache]:
    kv = FakeKVCache(capacity)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
                             async_scheduling=async_scheduling)
    return Scheduler(config, kv), kv


def add(scheduler: Scheduler, request_id: str, num_prompt_tokens: int, **params) -> Request:
    sampling = SamplingParams(**{"max_tokens": 4, **params})
    request = Request(request_id, list(range(1, num_prompt_tokens + 1)), sampling, frozenset({99}),
                      sampling.max_tokens, seed=0)
    scheduler.add_request(request)
    return request


def sample(scheduler: Scheduler, out, token: int = 5):
    """Every sampling request of ``out`` produces ``token``."""
    req_ids = list(out.num_scheduled_tokens)
    return scheduler.update(out, SampledTokens(req_ids, [token] * len(req_ids)))


def test_one_budget_running_first_then_waiting_in_arrival_order():
    scheduler, _ = make_scheduler(budget=16)
    add(scheduler, "a", 10)
    add(scheduler, "b", 10)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}  # b's prefill is chunked
    assert out.sampling_req_ids == {"a"} and [new.req_id for new in out.new_reqs] == ["a", "b"]
    sample(scheduler, out)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}  # a decodes, b finishes its prompt
    assert out.new_reqs == [] and out.cached_reqs.req_ids == ["a", "b"]


def test_max_num_seqs_caps_the_running_requests():
    scheduler, _ = make_scheduler(budget=64, max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 4)
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and scheduler.num_waiting == 1


def test_the_newest_running_request_is_preempted_and_resumes_from_scratch():
    scheduler, kv = make_scheduler(budget=64, capacity=20)
    add(scheduler, "a", 8, max_tokens=6)
    add(scheduler, "b", 8, max_tokens=6)
    sample(scheduler, scheduler.schedule())  # both prefilled: 16 of 20 tokens held
    for _ in range(3):
        out = scheduler.schedule()
        sample(scheduler, out)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"b"} and "b" in kv.freed
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    finished = set()
    for _ in range(30):
        finished |= {update.request.request_id for update in sample(scheduler, scheduler.schedule())
                     if update.finished}
    assert finished == {"a", "b"} and not kv.held


def test_stop_rules_eos_stop_ids_min_tokens_and_max_tokens():
    scheduler, _ = make_scheduler(budget=64)
    eos = add(scheduler, "eos", 3, max_tokens=10)
    stop_id = add(scheduler, "stop", 3, max_tokens=10, stop_token_ids=[42])
    held_back = add(scheduler, "min", 3, max_tokens=10, min_tokens=2)
    length = add(scheduler, "len", 3, max_tokens=1)
    out = scheduler.schedule()
    assert out.min_tokens_req_ids == {"min"}  # its stop tokens are banned this step
    scheduler.update(out, SampledTokens(["eos", "stop", "min", "len"], [99, 42, 99, 5]))
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 42
    assert not held_back.is_finished  # EOS under min_tokens does not stop
    assert length.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.schedule().finished_req_ids == {"eos", "stop", "len"}


def test_async_placeholders_hold_a_finished_prefill_until_its_token_arrives():
    scheduler, kv = make_scheduler(budget=64, async_scheduling=True)
    request = add(scheduler, "a", 5, max_tokens=2)
    first = scheduler.schedule()
    assert request.num_output_placeholders == 1
    second = scheduler.schedule()  # step 1 in flight: a decodes on its placeholder
    assert second.num_scheduled_tokens == {"a": 1} and request.num_output_placeholders == 2
    assert scheduler.schedule().is_empty  # max_tokens placeholders out: nothing more to compute
    assert kv.window_frees == ["a"]  # its last chunk's out-of-window blocks need not wait for the token
    sample(scheduler, first)
    updates = sample(scheduler, second)
    assert request.output_token_ids == [5, 5] and updates[0].finished


def test_a_token_for_an_aborted_request_is_dropped_and_its_id_can_return():
    scheduler, kv = make_scheduler(budget=64, async_scheduling=True)
    add(scheduler, "a", 5)
    out = scheduler.schedule()
    scheduler.abort_requests(["a"])
    assert "a" in kv.freed
    fresh = add(scheduler, "a", 3)  # the id is reused while the old step is in flight
    assert sample(scheduler, out) == [] and fresh.output_token_ids == []
    assert scheduler.schedule().finished_req_ids == {"a"}  # the old row is released
