"""Hybrid prefix caching on CUDA in bf16 through fla's chunk prefill and Weir's decode kernels,
eager and with CUDA graphs: requests sharing prefixes hit the lengths the CPU tests assert; their
prefill logits are as close to transformers' fp32 ones as a cache-off run's, and their greedy
tokens follow transformers' about as long; the state copies are exact and never sync. Runs on
the GPU machine (marked gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import assert_nothing_held, record_graph_replays, watch_engine
from helpers_models import make_tiny_qwen3_next
from weir import LLM, SamplingParams
from weir.testing import transformers_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_TOKENS = 16
BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Shapes fla's kernels take (key/value head dims multiples of 16), as in test_gpu_qwen3_next.
    return make_tiny_qwen3_next(
        tmp_path_factory.mktemp("qwen3_next_gpu_prefix"), with_tokenizer=True, hidden_size=256, head_dim=64,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, shared_expert_intermediate_size=128, intermediate_size=256)


def sequence() -> list[tuple[list[int], int]]:
    """(prompt, hit tokens when run one after another, block 16, retention 0)."""
    rng = random.Random(7)
    tokens = lambda count: [rng.randrange(256) for _ in range(count)]  # noqa: E731
    base = tokens(150)  # keeps its state at 144
    return [(base, 0), (base[:64] + tokens(40), 0),  # keeps its junction 64
            (base[:64] + tokens(30), 64), (base[:70] + tokens(9), 64), (base + tokens(70), 144), (base, 144)]


def relative_error(ours: torch.Tensor, truth: torch.Tensor) -> float:
    truth = truth.to(ours.device)
    return ((ours.float() - truth).abs().max() / truth.abs().max()).item()


def identical_prefix(tokens: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def run(checkpoint, prompts, eager: bool, prefix_caching: bool):
    llm = LLM(str(checkpoint), dtype="bfloat16", enforce_eager=eager, block_size=BLOCK, max_num_batched_tokens=128,
              gpu_memory_utilization=0.3, max_model_len=512, enable_prefix_caching=prefix_caching)
    assert llm.engine.runner.caches.backends["gated_delta_net"].name == "gdn_fla"
    watch = watch_engine(llm) if eager else None  # graph replays skip compute_logits
    outputs = [llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in prompts]
    first_logits = [watch.logits[o.request_id][0] for o in outputs] if eager else None
    assert_nothing_held(llm)
    del llm
    torch.cuda.empty_cache()
    return outputs, first_logits


@pytest.mark.parametrize("eager", [True, False])
def test_hits_stay_within_bf16_tolerance_of_a_cache_off_run(checkpoint, eager):
    cases = sequence()
    prompts = [prompt for prompt, _ in cases]
    truth = transformers_greedy(checkpoint, prompts, NUM_TOKENS, device="cuda", dtype="float32")
    off, off_logits = run(checkpoint, prompts, eager, prefix_caching=False)
    on, on_logits = run(checkpoint, prompts, eager, prefix_caching=True)
    assert [o.num_cached_tokens for o in on] == [hit for _, hit in cases]
    matched = {name: sum(identical_prefix(o.outputs[0].token_ids, reference) for o, (reference, _) in zip(runs, truth))
               for name, runs in (("on", on), ("off", off))}
    print(f"greedy tokens identical to transformers fp32 ({'eager' if eager else 'graphs'}): {matched}")
    assert matched["on"] >= 0.8 * matched["off"]
    if eager:  # each prompt's first logits, against transformers in fp32: as close as without hits
        errors = {name: [relative_error(ours, reference[0]) for ours, (_, reference) in zip(logits, truth)]
                  for name, logits in (("on", on_logits), ("off", off_logits))}
        print("prefill logits error", {name: [f"{e:.1e}" for e in values] for name, values in errors.items()})
        assert max(errors["on"]) <= max(3 * max(errors["off"]), 2e-2)


def test_checkpoint_copies_are_exact_and_never_sync():
    """The runner's state copies on CUDA (fla's state layout: the base backend's), under
    ``set_sync_debug_mode("error")``: an admission's load and a step's save copy whole slots."""
    from weir.kv_cache.state_checkpoints import StateCopies
    from weir.linear_attention import GatedDeltaNetLayerSpec
    from weir.plugins.attention.gdn_fla import FlaGDNBackend
    from weir.runner.linear_state import LinearAttentionState

    layers = [GatedDeltaNetLayerSpec(i, num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64, conv_kernel=4)
              for i in (0, 2)]
    backend = FlaGDNBackend(torch.bfloat16, torch.device("cuda"))
    state = LinearAttentionState(layers, lambda layer: backend, 3, max_num_seqs=4, room_bytes=2**30)
    state.allocate_checkpoints(3)
    for layer_state in state.layer_states + state.checkpoint_states:
        if layer_state is not None:
            layer_state.conv_state.normal_()
            layer_state.recurrent_state.normal_()
    expected_saved = [s.recurrent_state[1].clone() for s in state.layer_states if s is not None]
    expected_loaded = [s.conv_state[2].clone() for s in state.checkpoint_states if s is not None]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.admit([0, 3], StateCopies(loads=[(2, 3)]), torch.device("cuda"), pin_memory=True)
        state.save_checkpoints(StateCopies(saves=[(1, 0)]), torch.device("cuda"), pin_memory=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for index, layer in enumerate(layers):
        live, kept = state.layer_states[layer.layer_idx], state.checkpoint_states[layer.layer_idx]
        assert not live.conv_state[0].any() and not live.recurrent_state[0].any()  # admitted without a hit
        assert torch.equal(live.conv_state[3], expected_loaded[index])
        assert torch.equal(kept.recurrent_state[0], expected_saved[index])


def test_checkpoints_saved_in_verify_graphs_hold_the_committed_state(checkpoint):
    """Under speculation a prefill chunk of at most ``1 + k`` tokens beside a verifying request
    runs in a verify-width graph, whose linear-attention rows move their slots only when
    verification commits them: a checkpoint at the chunk's end must be saved after that, or it
    holds the chunk's start and the prompt resuming from it gets other greedy tokens. As
    ``test_spec_decode_engine``'s CPU test of the same name, replaying the graphs: budget 66 and a
    5-token neighbour put the 104-token prompt's chunk 61-64 (its junction with the first
    prompt) beside the neighbour's first verify step. fp32, so the tokens must be equal."""
    rng = random.Random(11)
    base = [rng.randrange(256) for _ in range(150)]
    junction = base[:64] + [rng.randrange(256) for _ in range(40)]
    resumes = base[:64] + [rng.randrange(256) for _ in range(30)]
    neighbour = [rng.randrange(256) for _ in range(5)]

    def generate(**options):
        llm = LLM(str(checkpoint), dtype="float32", block_size=BLOCK, max_num_batched_tokens=66,
                  gpu_memory_utilization=0.3, max_model_len=512, **options)
        replays = record_graph_replays(llm)
        outputs = [llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False)
                   for batch in ([base], [neighbour, junction], [resumes])]
        assert_nothing_held(llm)
        del llm
        torch.cuda.empty_cache()
        return [o for batch in outputs for o in batch], {width for _, width, _ in replays}

    want, _ = generate(enable_prefix_caching=False)
    got, widths = generate(enable_prefix_caching=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False})
    assert 4 in widths  # verify steps (the junction's 3-token chunk among them) replayed width-4 graphs
    assert got[-1].num_cached_tokens == 64
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
