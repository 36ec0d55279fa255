"""The engine end to end on CUDA, bf16: greedy parity with transformers, graphs vs eager, and
no implicit device synchronisation in the step loop. Runs on the GPU machine (marked gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import (assert_greedy_parity, assert_nothing_held, assert_steps_do_not_sync, hf_greedy_bf16,
                            record_graph_replays)
from helpers_models import make_tiny_qwen3
from weir import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3_gpu"), with_tokenizer=True, num_hidden_layers=4,
                           hidden_size=256, intermediate_size=512, head_dim=64)


def test_qwen3_bf16_parity_with_graphs_and_eager(qwen3_path):
    """Graphs and eager both follow transformers. They are not compared token for token with each
    other: a padded graph batch runs other GEMM kernels, and bf16 rounding then breaks near-ties
    differently (seen on the H200: one flip at token 8 of one prompt)."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 33, 64, 100, 130, 7, 250)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    results = {}
    for eager in (False, True):
        llm = LLM(str(qwen3_path), dtype="bfloat16", enforce_eager=eager, max_num_batched_tokens=128,
                  gpu_memory_utilization=0.3, max_model_len=512)
        assert (llm.engine.runner.graphs is not None) == (not eager and llm.engine.runner.caches.supports_cuda_graphs)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outputs]
        assert_nothing_held(llm)
        del llm
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.bfloat16).cuda()
    references = [hf_greedy_bf16(hf, p, NUM_TOKENS) for p in prompts]
    for eager, outputs in results.items():
        matched = [assert_greedy_parity(ours, *reference, margin_tol=0.25)
                   for ours, reference in zip(outputs, references)]
        print("eager" if eager else "graphs", "tokens identical before any near-tie divergence:", matched)


def test_mixed_steps_replay_graphs_and_follow_transformers(qwen3_path):
    """cudagraph_mode "full": steps with prefill chunks beside decodes replay mixed-step graphs
    ("full_decode_only": none do), follow transformers as eager steps do, and sync nothing."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(2)
    # Chunks of 128 tokens: the long prompts prefill beside the short ones' decodes.
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 9, 40, 70, 130, 250, 3, 200)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.bfloat16).cuda()
    references = [hf_greedy_bf16(hf, p, NUM_TOKENS) for p in prompts]
    del hf
    for mode in ("full", "full_decode_only"):
        llm = LLM(str(qwen3_path), dtype="bfloat16", cudagraph_mode=mode, max_num_batched_tokens=128,
                  gpu_memory_utilization=0.3, max_model_len=512)
        runner = llm.engine.runner
        assert runner.mixed_graph_shapes == ([(128, 32), (64, 32)] if mode == "full" else [])
        replays = record_graph_replays(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        mixed_replays = sum(tokens is not None for _, _, tokens in replays)
        assert (mixed_replays > 0) == (mode == "full"), f"{mode}: {mixed_replays} mixed-step graph replays"
        matched = [assert_greedy_parity(o.outputs[0].token_ids, *reference, margin_tol=0.25)
                   for o, reference in zip(outputs, references)]
        print(mode, f"{mixed_replays} mixed replays; tokens identical before any near-tie divergence:", matched)
        assert_nothing_held(llm)
        del llm
        torch.cuda.empty_cache()
    # Mixed steps among the checked ones: 24 prompts of 40+ tokens prefill in chunks beside decodes.
    llm = LLM(str(qwen3_path), dtype="bfloat16", max_num_batched_tokens=256, gpu_memory_utilization=0.3,
              max_model_len=512)
    assert llm.engine.runner.mixed_graph_shapes
    assert_steps_do_not_sync(llm)


def test_graph_pool_fits_in_what_kv_sizing_reserved(tmp_path):
    """Every graph keeps its own [size, vocab] logits alive in the pool (2.4 GiB for Qwen3's vocab
    over 36 sizes): KV sizing must reserve them, or the engine overshoots gpu_memory_utilization."""
    from weir.runner.cuda_graphs import graph_pool_bytes_estimate

    path = make_tiny_qwen3(tmp_path, num_hidden_layers=2, hidden_size=128, intermediate_size=256, head_dim=32,
                           vocab_size=32000)
    runner = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=256).engine.runner
    assert runner.kernels_compiled_ahead  # else eager runs before each capture add their own blocks
    logits_bytes = graph_pool_bytes_estimate(0, runner.capture_sizes, 32000 * 2)
    assert logits_bytes > 400 * 2**20  # the term this test is about dominates the pool here
    # Beyond the estimate: the capture stream's cuBLAS workspace (32 MiB on Hopper) and small blocks.
    assert logits_bytes <= runner.graphs.pool_bytes <= runner.graph_reserve_bytes + 64 * 2**20


def test_default_model_bf16_matches_transformers():
    from transformers import AutoModelForCausalLM

    from weir.default_model import ensure_default_model
    from weir.tokenizer import apply_chat_template

    llm = LLM(dtype="bfloat16", gpu_memory_utilization=0.3)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.chat(question, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text
    gguf = ensure_default_model()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16).cuda()
    prompt_ids = apply_chat_template(llm.get_tokenizer(), question, None)
    hf_tokens, hf_logits = hf_greedy_bf16(hf, prompt_ids, len(answer.token_ids))
    assert_greedy_parity(answer.token_ids, hf_tokens, hf_logits, margin_tol=0.25)


def test_no_implicit_sync_in_the_step_loop(qwen3_path):
    assert_steps_do_not_sync(LLM(str(qwen3_path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512))
