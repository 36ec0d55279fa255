"""The linear-attention state-slot pool and its use by the cache manager and the scheduler:
a slot per running request, taken at admission, given back at finish, abort and preemption."""

from __future__ import annotations

import pytest

from weir.config import SchedulerConfig
from weir.kv_cache import GroupConfig, KVCacheManager
from weir.kv_cache.state_slots import StateSlotPool
from weir.request import Request, RequestStatus
from weir.sampling_params import SamplingParams
from weir.scheduler import Scheduler


def test_pool_hands_out_each_slot_once():
    pool = StateSlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.allocate() is None
    pool.check_invariants()
    pool.free(slots[1])
    assert pool.num_free == 1 and pool.allocate() == slots[1]
    with pytest.raises(ValueError, match="state slot 7 is not held"):
        pool.free(7)
    pool.free(slots[0])
    with pytest.raises(ValueError, match="is not held"):
        pool.free(slots[0])
    pool.check_invariants()
    with pytest.raises(ValueError, match="at least 1 state slot"):
        StateSlotPool(0)


def _request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4) -> Request:
    return Request(request_id, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens),
                   frozenset(), max_tokens, seed=0)


def _scheduler(num_blocks: int, num_slots: int, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                             async_scheduling=False)
    return Scheduler(config, KVCacheManager(4, [GroupConfig(num_blocks)], enable_prefix_caching=False,
                                                   num_state_slots=num_slots))


def test_admission_waits_for_a_free_slot_and_finish_returns_it():
    scheduler = _scheduler(num_blocks=64, num_slots=2)
    for index in range(3):
        scheduler.add_request(_request(f"r{index}", 6))
    out = scheduler.schedule()
    assert [new.req_id for new in out.new_reqs] == ["r0", "r1"]  # r2 has no slot yet
    assert sorted(new.state_slot for new in out.new_reqs) == [0, 1]
    pool = scheduler.kv_cache.state_slots
    assert pool.num_free == 0
    freed_slot = scheduler.requests["r0"].state_slot
    scheduler.finish_request("r0", RequestStatus.FINISHED_STOPPED)
    assert pool.num_free == 1
    out = scheduler.schedule()
    assert [new.req_id for new in out.new_reqs] == ["r2"] and out.new_reqs[0].state_slot == freed_slot
    scheduler.finish_request("r1", RequestStatus.FINISHED_ABORTED)  # abort while running
    scheduler.finish_request("r2", RequestStatus.FINISHED_ABORTED)
    pool.check_invariants()
    assert pool.num_free == 2


def test_preemption_gives_the_slot_back_and_resumes_with_a_fresh_one():
    # 5 usable blocks of 4 tokens: two requests of 8 prompt tokens fill 4; growing both preempts one.
    scheduler = _scheduler(num_blocks=6, num_slots=2, budget=16)
    scheduler.add_request(_request("a", 8, max_tokens=20))
    scheduler.add_request(_request("b", 8, max_tokens=20))
    scheduler.schedule()
    pool = scheduler.kv_cache.state_slots
    for step in range(12):
        out = scheduler.schedule()
        if out.preempted_req_ids:
            break
        for request in scheduler.running:  # pretend each step produced a token
            request.num_output_placeholders = 0
            request.output_token_ids.append(1)
    assert out.preempted_req_ids == {"b"}
    assert scheduler.requests["b"].state_slot is None and pool.num_free == 1
    scheduler.requests["b"].num_output_placeholders = 0  # its last sampled token has arrived
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = scheduler.schedule()
    assert [new.req_id for new in out.new_reqs] == ["b"]
    assert out.new_reqs[0].num_computed_tokens == 0 and out.new_reqs[0].state_slot is not None
    pool.check_invariants()


def test_waiting_requests_never_hold_a_slot():
    scheduler = _scheduler(num_blocks=64, num_slots=1)
    scheduler.add_request(_request("a", 6))
    scheduler.add_request(_request("b", 6))
    scheduler.schedule()
    assert scheduler.requests["b"].state_slot is None
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)  # aborted while waiting
    assert scheduler.kv_cache.state_slots.num_free == 0  # a still holds the only slot
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache.state_slots.num_free == 1
