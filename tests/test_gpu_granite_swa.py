"""Granite SWA and GraniteMoe SWA end to end on CUDA, bf16: greedy parity with transformers
through the Triton backends (windows and sinks in the paged kernels, top-k-softmax MoE), with
CUDA graphs (mixed steps too) and eagerly, windowed blocks freed as requests decode, and no implicit device
synchronisation in the step loop. Runs on the GPU machine (marked gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import (assert_greedy_parity, assert_nothing_held, assert_steps_do_not_sync, hf_greedy_bf16,
                            record_graph_replays, watch_engine)
from helpers_models import make_tiny_granite_swa, make_tiny_granitemoe_swa
from weir import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_TOKENS = 32
SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              sliding_window=24)  # head_dim 64; a window far shorter than the longer prompts


@pytest.fixture(scope="module", params=["granite_swa", "granitemoe_swa"])
def checkpoint(request, tmp_path_factory):
    maker = make_tiny_granite_swa if request.param == "granite_swa" else make_tiny_granitemoe_swa
    overrides = dict(SHAPES)
    if request.param == "granitemoe_swa":
        overrides.update(intermediate_size=128, shared_intermediate_size=128)
    return maker(tmp_path_factory.mktemp(request.param), with_tokenizer=True, **overrides)


def test_bf16_parity_with_graphs_and_eager(checkpoint):
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 33, 64, 100, 130, 7, 250)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    results = {}
    for eager in (False, True):
        llm = LLM(str(checkpoint), dtype="bfloat16", enforce_eager=eager, max_num_batched_tokens=128,
                  gpu_memory_utilization=0.3, max_model_len=512)
        runner = llm.engine.runner
        assert (runner.graphs is not None) == (not eager)
        assert {backend.name for backend in runner.caches.backends.values()} == {"triton"}
        assert [group.sliding_window for group in runner.caches.groups] == [None, 24]

        replays = record_graph_replays(llm) if not eager else []
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outputs]
        # The 128-token step budget chunks the long prompts beside decodes: mixed-step graphs,
        # the MoE model's too (attention zeroes the padding tokens' rows before its router).
        assert eager or any(tokens is not None for _, _, tokens in replays), "no mixed-step graph replayed"
        assert_nothing_held(llm)
        del llm
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda()
    references = [hf_greedy_bf16(hf, p, NUM_TOKENS) for p in prompts]
    for eager, outputs in results.items():
        matched = [assert_greedy_parity(ours, *reference, margin_tol=0.25)
                   for ours, reference in zip(outputs, references)]
        print("eager" if eager else "graphs", "tokens identical before any near-tie divergence:", matched)


def test_decode_steps_do_not_sync(checkpoint):
    llm = LLM(str(checkpoint), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512)
    assert_steps_do_not_sync(llm)
