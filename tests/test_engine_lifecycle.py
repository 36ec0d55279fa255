"""Request lifecycles at the edges: a failed step (and the requests it spares), ids reused while a
step is in flight, child ids of n>1, stop strings against min_tokens and max_tokens; an engine's
memory freed once dropped."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine_harness import assert_nothing_held
from weir import LLM, SamplingParams

PROMPT = {"prompt_token_ids": list(range(40, 80))}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run_to_end(engine, request_id):
    last = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                last = output
    return last


def test_failed_step_does_not_poison_the_prefix_cache(tiny_llama_path):
    reference = LLM(str(tiny_llama_path), device="cpu", max_model_len=256, block_size=4,
                    enable_prefix_caching=False)
    expected = reference.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    llm = LLM(str(tiny_llama_path), device="cpu", max_model_len=256, block_size=4)
    model = llm.engine.runner.model

    def broken_forward(*args, **kwargs):
        raise RuntimeError("injected failure")

    model.forward = broken_forward
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    del model.forward
    assert_nothing_held(llm)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_step_aborts_what_ran_and_spares_what_waited(tiny_llama_path, async_scheduling):
    llm = LLM(str(tiny_llama_path), device="cpu", max_model_len=256, block_size=4, max_num_seqs=2,
               async_scheduling=async_scheduling)
    waiting_prompt = {"prompt_token_ids": list(range(100, 130))}
    expected = llm.generate(waiting_prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    long_run = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("running", PROMPT, long_run)
    engine.add_request("running-n2", PROMPT, long_run.clone(n=2, temperature=0.8, seed=1))  # both slots
    engine.add_request("waiting", waiting_prompt, GREEDY)  # max_num_seqs=2: it cannot start yet
    engine.step()
    engine.step()
    engine.runner.execute = lambda *args: (_ for _ in ()).throw(RuntimeError("injected failure"))
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.step()
    del engine.runner.execute
    assert sorted(engine.reset_after_failure()) == ["running", "running-n2"]
    assert run_to_end(engine, "waiting").outputs[0].token_ids == expected
    assert_nothing_held(llm)


def test_a_failure_while_building_outputs_loses_no_finished_request(tiny_llama_path, monkeypatch):
    """Requests that finished in the failed step were forgotten before their outputs were all
    built; the reset must still report them, or their callers wait forever."""
    from weir.engine import _Parent

    llm = LLM(str(tiny_llama_path), device="cpu", max_model_len=256, block_size=4)
    engine = llm.engine
    for name in ("a", "b"):
        engine.add_request(name, {"prompt_token_ids": list(range(40, 60))}, GREEDY.clone(max_tokens=3))
    original, finished_outputs = _Parent.output, []

    def output(parent, finished):
        built = original(parent, finished)
        if built.finished:
            finished_outputs.append(built.request_id)
            if len(finished_outputs) == 2:
                raise RuntimeError("injected failure")
        return built

    monkeypatch.setattr(_Parent, "output", output)
    with pytest.raises(RuntimeError, match="injected failure"):
        while engine.has_unfinished_requests():
            engine.step()
    assert sorted(engine.reset_after_failure()) == ["a", "b"]
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


def fail_the_step_whose_output(engine, releases):
    """Make ``runner.execute`` raise, before it applies anything, on the first step whose output
    satisfies ``releases(output)``."""
    original = engine.runner.execute

    def execute(out):
        if releases(out):
            engine.runner.execute = original
            raise RuntimeError("injected failure")
        return original(out)

    engine.runner.execute = execute


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("release", ["finished", "preempted"])
def test_rows_a_failed_step_was_releasing_are_released(tiny_llama_path, async_scheduling, release):
    """A step's output is the only message that tells the runner to drop the rows of requests
    finished or preempted before it: failing that step must not leak them."""
    kv_bytes = {"finished": None, "preempted": 20 * 4 * 2 * 2 * 16 * 4 * 2}  # 20 blocks of 4 tokens
    llm = LLM(str(tiny_llama_path), device="cpu", max_model_len=64, block_size=4, max_num_seqs=3,
              async_scheduling=async_scheduling, kv_cache_memory_bytes=kv_bytes[release])
    engine = llm.engine
    for index, max_tokens in enumerate([2, 40, 40]):
        engine.add_request(f"r{index}", {"prompt_token_ids": list(range(10 * index, 10 * index + 12))},
                           GREEDY.clone(max_tokens=max_tokens))
    fail_the_step_whose_output(engine, lambda out: bool(getattr(out, f"{release}_req_ids")))
    with pytest.raises(RuntimeError, match="injected failure"):
        while engine.has_unfinished_requests():
            engine.step()
    engine.reset_after_failure()
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)
    # Every row is free again: a batch of max_num_seqs requests fits.
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, GREEDY.clone(max_tokens=4), use_tqdm=False)
    assert all(len(output.outputs[0].token_ids) == 4 for output in outputs)


def test_prefix_cache_statistics_count_each_admission_once(tiny_llama_path):
    """A request that cannot get blocks is looked up again every step; it is counted once, when
    admitted."""
    llm = LLM(str(tiny_llama_path), device="cpu", max_model_len=64, block_size=4,
              kv_cache_memory_bytes=18 * 4 * 2 * 2 * 16 * 4 * 2)  # 17 usable blocks of 4 tokens
    engine, kv_cache = llm.engine, llm.engine.scheduler.kv_cache
    engine.add_request("big", {"prompt_token_ids": list(range(100, 156))}, GREEDY.clone(max_tokens=8))
    engine.step()
    engine.add_request("small", {"prompt_token_ids": list(range(30, 51))}, GREEDY.clone(max_tokens=1))
    for _ in range(3):  # "small" waits for blocks meanwhile
        engine.step()
    assert engine.scheduler.num_waiting == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert kv_cache.num_prefix_queries == 56 + 21


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_id_reused_after_abort_gets_only_its_own_tokens(tiny_llama_path, async_scheduling):
    llm = LLM(str(tiny_llama_path), device="cpu", max_model_len=256, async_scheduling=async_scheduling)
    other = {"prompt_token_ids": list(range(100, 130))}
    expected = llm.generate(other, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("r")
    engine.add_request("r", other, GREEDY)  # while the aborted request's step may be in flight
    assert run_to_end(engine, "r").outputs[0].token_ids == expected
    assert_nothing_held(llm)


def test_child_ids_of_n_cannot_collide(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("x", PROMPT, SamplingParams(n=2, max_tokens=4))
    with pytest.raises(ValueError, match="'x-1' is already in use"):
        engine.add_request("x-1", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request("x", PROMPT, GREEDY)
    run_to_end(engine, "x")
    assert_nothing_held(tiny_llm)


def greedy_text(llm, max_tokens):
    return llm.generate(PROMPT, GREEDY.clone(max_tokens=max_tokens), use_tqdm=False)[0].outputs[0]


def test_stop_strings_wait_for_min_tokens(tiny_llm):
    text = greedy_text(tiny_llm, 40).text
    start = next(i for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    held = tiny_llm.generate(PROMPT, GREEDY.clone(max_tokens=40, stop=[stop], min_tokens=20),
                             use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 20


def test_stop_string_on_the_last_allowed_token_is_a_stop(tiny_llm):
    tokens = greedy_text(tiny_llm, 40).token_ids
    tokenizer = tiny_llm.get_tokenizer()
    for count in range(3, 40):  # a token count whose text ends in a stop string seen nowhere before
        text = tokenizer.decode(tokens[:count])
        stop = text[-2:]
        if "\ufffd" not in stop and stop not in text[:-1] and tokenizer.decode(tokens[:count - 1]) != text:
            break
    else:
        pytest.fail("no usable stop string in the greedy text")
    output = tiny_llm.generate(PROMPT, GREEDY.clone(max_tokens=count, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert output.text == text[:-2]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)


def test_dropped_engine_is_collected_even_in_a_reference_cycle(tiny_llama_path):
    """On CUDA the runner and its graph runner refer to each other; such an engine, alive when a
    second one was built, must still be collected (and free its device memory) once dropped."""
    first = LLM(str(tiny_llama_path), device="cpu", max_model_len=256, block_size=4)
    first.engine.runner.self_reference = first.engine.runner  # the cycle the CUDA graph runner makes
    runner_alive = weakref.ref(first.engine.runner)
    second = LLM(str(tiny_llama_path), device="cpu", max_model_len=256, block_size=4)
    del first
    gc.collect()
    assert runner_alive() is None
    assert second.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
