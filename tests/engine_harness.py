"""Runs Weir's engine the way a test needs to watch it: every step's logits captured per
request, and the KV pool's invariants checked after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weir.llm import LLM


@dataclass
class Watch:
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # req_id -> [V] per sample
    num_steps: int = 0


def watch_engine(llm: LLM) -> Watch:
    """Instrument ``llm`` in place: capture sampled rows' logits, check invariants each step."""
    watch = Watch()
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    last_logits: list[torch.Tensor] = []
    original_logits, original_execute, original_step = model.compute_logits, runner.execute, engine.step

    def compute_logits(hidden):
        logits = original_logits(hidden)
        last_logits.append(logits.detach().float().clone())
        return logits

    def execute(scheduler_output):
        last_logits.clear()
        handle = original_execute(scheduler_output)
        if handle is not None:
            for batch_idx, req_id in enumerate(scheduler_output.num_scheduled_tokens):
                if req_id in scheduler_output.sampling_req_ids:
                    watch.logits.setdefault(req_id, []).append(last_logits[0][batch_idx])
        return handle

    def step():
        outputs = original_step()
        engine.scheduler.kv_cache.check_invariants()
        watch.num_steps += 1
        return outputs

    model.compute_logits = compute_logits
    runner.execute = execute
    engine.step = step
    return watch


def record_graph_replays(llm: LLM) -> list[tuple[int, int, int | None]]:
    """Instrument ``llm``'s CUDA graphs in place; the returned list gets ``(batch size, width,
    mixed-step token count or None)`` of every replay from then on."""
    graphs = llm.engine.runner.graphs
    replays: list[tuple[int, int, int | None]] = []
    original = graphs.replay

    def replay(batch_size, width=1, num_tokens=None):
        replays.append((batch_size, width, num_tokens))
        return original(batch_size, width, num_tokens)

    graphs.replay = replay
    return replays


def assert_nothing_held(llm: LLM) -> None:
    """Once every request is finished or aborted, no block and no table row is held."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.kv_cache.check_invariants(idle=True)
    assert engine.runner.table.row_of == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting


def hf_greedy(model_path, prompt_token_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its logits ([num_tokens, V]), EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return hf_greedy_with(model, prompt_token_ids, num_tokens)


@torch.no_grad()
def hf_greedy_with(model, prompt_token_ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """A plain greedy loop over transformers' own forward with its KV cache (no EOS handling)."""
    out = model(input_ids=torch.tensor([prompt_token_ids]), use_cache=True)
    tokens, logits = [], []
    for _ in range(num_tokens):
        step_logits = out.logits[0, -1].float()
        logits.append(step_logits)
        tokens.append(int(step_logits.argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


def assert_steps_do_not_sync(llm: LLM, num_requests: int = 24, num_steps: int = 20) -> None:
    """Sampled decode steps on CUDA under ``set_sync_debug_mode("error")``: any implicit sync
    (``.item()``, an unpinned copy...) raises. The host may wait only on the copy event of the
    step before. Every request then finishes and nothing stays held."""
    import random

    from weir import SamplingParams

    engine = llm.engine
    rng = random.Random(1)
    for index in range(num_requests):
        engine.add_request(str(index), {"prompt_token_ids": [rng.randrange(256) for _ in range(40 + index)]},
                           SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True, seed=index))
    for _ in range(4):  # prefill and warm-up
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


@torch.no_grad()
def hf_greedy_bf16(model, prompt_ids: list[int], num_tokens: int):
    out = model(input_ids=torch.tensor([prompt_ids], device="cuda"), use_cache=True)
    tokens, logits = [], []
    for _ in range(num_tokens):
        step_logits = out.logits[0, -1].float()
        logits.append(step_logits)
        tokens.append(int(step_logits.argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]], device="cuda"),
                    past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


def assert_greedy_parity(weir_tokens, hf_tokens, hf_logits, margin_tol):
    """Identical until the first difference; a difference is allowed only where transformers'
    own top-2 margin is within bf16 noise (two near-tied tokens)."""
    for index, (ours, theirs) in enumerate(zip(weir_tokens, hf_tokens)):
        if ours != theirs:
            margin = (hf_logits[index][theirs] - hf_logits[index][ours]).item()
            assert margin <= margin_tol, (f"token {index}: {ours} vs {theirs}, reference margin {margin:.3g} "
                                          f"(at most {margin_tol:.3g})")
            return index
    assert len(weir_tokens) == len(hf_tokens)
    return len(weir_tokens)
