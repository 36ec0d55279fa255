"""Sampling through the whole engine: seeds, top_k=1, stop strings, min_tokens, penalties,
logprobs and n."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import assert_nothing_held, watch_engine
from helpers_models import make_tiny_qwen3
from weir import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]}


def token_prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(3, 40))]} for _ in range(count)]


def generate_one(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_seeded_request_is_reproducible_whatever_else_is_in_the_batch(tiny_llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = generate_one(tiny_llm, seeded).token_ids
    others = [SamplingParams(temperature=t, top_p=p, max_tokens=m, ignore_eos=True)
              for t, p, m in [(0.7, 0.9, 5), (1.3, 1.0, 30), (0.0, 1.0, 12), (1.0, 0.5, 20)]]
    for mix_seed, position in [(1, 0), (2, 2), (3, 4)]:
        prompts = token_prompts(4, mix_seed)
        params = list(others)
        prompts.insert(position, PROMPT)
        params.insert(position, seeded)
        outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
        assert outputs[position].outputs[0].token_ids == alone
    other_seed = generate_one(tiny_llm, seeded.clone(seed=4321)).token_ids
    assert other_seed != alone
    assert_nothing_held(tiny_llm)


def test_top_k_1_equals_greedy(tiny_llm):
    greedy = generate_one(tiny_llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    top1 = generate_one(tiny_llm, SamplingParams(temperature=1.5, top_k=1, max_tokens=24, ignore_eos=True))
    assert top1.token_ids == greedy.token_ids
    # A denormal temperature would overflow the logits to inf (and sample token 0): it is greedy.
    tiny = generate_one(tiny_llm, SamplingParams(temperature=1e-40, max_tokens=24, ignore_eos=True))
    assert tiny.token_ids == greedy.token_ids


def test_a_completion_cut_inside_a_character_keeps_its_bytes(tiny_llm, monkeypatch):
    """max_tokens ends the completion two bytes into a four-byte emoji: the text must still say
    what the tokens say (as tokenizer.decode does), not drop them."""
    model = tiny_llm.engine.runner.model
    original = model.compute_logits
    script = [ord("a"), ord("b"), *"🎉".encode()[:2]]  # the tiny tokenizer's ids are bytes

    def forced(hidden):
        logits = torch.full_like(original(hidden), -10.0)  # [rows, vocab]
        for row in range(logits.shape[0]):
            logits[row, script.pop(0) if script else ord("x")] = 10.0
        return logits

    monkeypatch.setattr(model, "compute_logits", forced)
    output = generate_one(tiny_llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert output.token_ids == [97, 98, 240, 159]
    assert output.text == tiny_llm.get_tokenizer().decode(output.token_ids) == "ab\ufffd"


def test_stop_string_is_cut_and_reported(tiny_llm):
    greedy = generate_one(tiny_llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = greedy.text
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    stopped = generate_one(tiny_llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert stopped.text == text[: text.index(stop)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert len(stopped.token_ids) < len(greedy.token_ids)


def test_stop_token_and_min_tokens(tiny_llm):
    greedy = generate_one(tiny_llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).token_ids
    stop_token = greedy[3]
    first = greedy.index(stop_token)
    stopped = generate_one(tiny_llm, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]))
    assert stopped.token_ids == greedy[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token

    held = generate_one(tiny_llm, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token],
                                                 min_tokens=10))
    assert len(held.token_ids) >= 10
    assert stop_token not in held.token_ids[:10]  # banned until min_tokens are out
    if held.finish_reason == "stop":
        assert held.token_ids[-1] == stop_token and stop_token not in held.token_ids[:-1]
    else:
        assert len(held.token_ids) == 30


def penalised(raw_logits, prompt_ids, output_ids, presence=0.0, frequency=0.0, repetition=1.0):
    logits = raw_logits.clone()
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=logits.shape[0])
    seen = counts > 0
    seen[torch.tensor(prompt_ids)] = True
    logits = torch.where(seen & (logits > 0), logits / repetition, logits)
    logits = torch.where(seen & (logits <= 0), logits * repetition, logits)
    return logits - frequency * counts - presence * (counts > 0).float()


def test_penalties_change_what_they_should(tiny_llm):
    prompt_ids = PROMPT["prompt_token_ids"]
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = generate_one(tiny_llm, base).token_ids
    for penalty in [dict(frequency=1.5), dict(presence=1.5), dict(repetition=3.0)]:
        params = base.clone(frequency_penalty=penalty.get("frequency", 0.0),
                            presence_penalty=penalty.get("presence", 0.0),
                            repetition_penalty=penalty.get("repetition", 1.0))
        watch = watch_engine_fresh(tiny_llm)
        output = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
        tokens = output.outputs[0].token_ids
        raw = watch.logits[output.request_id]
        for index, token in enumerate(tokens):
            expected = penalised(raw[index], prompt_ids, tokens[:index], **penalty)
            assert int(expected.argmax()) == token, (penalty, index)
        assert tokens != plain, penalty
    assert len(set(generate_one(tiny_llm, base.clone(presence_penalty=2.0)).token_ids)) >= len(set(plain))


def watch_engine_fresh(llm):
    """watch_engine on an engine that may already be instrumented: unwrap first."""
    for obj, name in [(llm.engine.runner.model, "compute_logits"), (llm.engine.runner, "execute"),
                      (llm.engine, "step")]:
        obj.__dict__.pop(name, None)
    return watch_engine(llm)


def test_logprobs_equal_log_softmax_of_the_logits(tiny_llm):
    watch = watch_engine_fresh(tiny_llm)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=5)
    output = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
    completion = output.outputs[0]
    raw = watch.logits[output.request_id]
    assert len(completion.logprobs) == len(completion.token_ids)
    cumulative = 0.0
    for index, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = torch.log_softmax(raw[index], dim=-1)
        assert abs(entry[token].logprob - expected[token].item()) < 1e-5
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top_values, top_ids = expected.topk(5)
        for rank, (value, token_id) in enumerate(zip(top_values.tolist(), top_ids.tolist()), start=1):
            assert abs(entry[token_id].logprob - value) < 1e-5
        assert set(entry) <= set(top_ids.tolist()) | {token}
        cumulative += expected[token].item()
    assert abs(completion.cumulative_logprob - cumulative) < 1e-4
    tokenizer = tiny_llm.engine.tokenizer
    assert all(logprob.decoded_token == tokenizer.decode([token_id])
               for entry in completion.logprobs for token_id, logprob in entry.items())


def test_n_completions_share_one_prompt(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    first = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
    again = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in first.outputs)
    assert_nothing_held(tiny_llm)


def test_the_stop_token_or_string_is_left_out_of_the_text_unless_asked_for(tiny_llm):
    """As vLLM: token_ids keep the token that ended the completion, the text does not; with
    include_stop_str_in_output the text keeps the stop token's text or the stop string."""
    tokenizer = tiny_llm.engine.tokenizer
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = generate_one(tiny_llm, SamplingParams(**greedy)).token_ids
    stop_token = tokens[4]
    first = tokens.index(stop_token)
    stopped = generate_one(tiny_llm, SamplingParams(**greedy, stop_token_ids=[stop_token]))
    assert stopped.token_ids == tokens[:first + 1] and stopped.stop_reason == stop_token
    assert stopped.text == tokenizer.decode(tokens[:first])
    kept = generate_one(tiny_llm, SamplingParams(**greedy, stop_token_ids=[stop_token],
                                                 include_stop_str_in_output=True))
    assert kept.text == tokenizer.decode(tokens[:first + 1])
    full_text = tokenizer.decode(tokens)
    stop = full_text[5:7]
    cut = full_text.index(stop)
    with_stop = generate_one(tiny_llm, SamplingParams(**greedy, stop=[stop], include_stop_str_in_output=True))
    assert with_stop.text == full_text[:cut + len(stop)] and with_stop.stop_reason == stop
    assert generate_one(tiny_llm, SamplingParams(**greedy, stop=[stop])).text == full_text[:cut]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steps_with_every_sampling_kind_never_synchronise(tmp_path):
    """Penalties (the Triton penalty kernel over the sampler's per-row state), min_tokens bans,
    logprobs and every filter in one running batch on CUDA, with requests admitted mid-run
    (their rows staged and their penalty state reset): no step synchronises, all finish."""
    llm = LLM(str(make_tiny_qwen3(tmp_path, with_tokenizer=True)), dtype="bfloat16", gpu_memory_utilization=0.3,
              max_model_len=512)
    engine = llm.engine
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=12, stop_token_ids=[5, 6], max_tokens=30),
        SamplingParams(temperature=0.7, top_k=20, logprobs=3, max_tokens=30, ignore_eos=True, seed=4),
        SamplingParams(min_p=0.1, frequency_penalty=0.5, presence_penalty=0.5, max_tokens=30, ignore_eos=True),
    ]
    rng = random.Random(3)

    def add(index):
        prompt = {"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(5, 60))]}
        engine.add_request(str(index), prompt, kinds[index % len(kinds)])

    for index in range(8):
        add(index)
    for _ in range(3):  # prefill and warm-up
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit synchronisation raises
    try:
        for step in range(16):
            if step % 4 == 0:
                add(100 + step)
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)
