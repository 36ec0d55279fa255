"""A layer kind Weir has never heard of is a spec and a backend in a plugin: the fixture plugin
``weir-toy-kinds`` (tests/fixtures/toy_kinds_plugin) brings a paged per-token kind and a state
kind, and its model serves through chunked prefill and preemption, matching its own whole-sequence
maths, with no change to the runner, the KV manager or the request table."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_harness import assert_nothing_held, watch_engine
from helpers_models import save_tiny_tokenizer
from weir import LLM, SamplingParams

pytestmark = pytest.mark.integration  # parity through the whole engine

PLUGIN_DIR = Path(__file__).parent / "fixtures" / "toy_kinds_plugin"
VOCAB, HIDDEN, LATENT = 320, 16, 8
NUM_TOKENS = 24


@pytest.fixture
def toy_checkpoint(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=LATENT, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=256,
                architectures=["ToyKindsForCausalLM"]).save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(0)
    shapes = {"embed": (VOCAB, HIDDEN), "mean_proj": (LATENT, HIDDEN), "mean_out": (HIDDEN, LATENT),
              "sum_proj": (HIDDEN, HIDDEN), "lm_head": (VOCAB, HIDDEN)}
    weights = {name: torch.randn(shape, generator=generator) * 0.1 for name, shape in shapes.items()}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    save_tiny_tokenizer(tmp_path, VOCAB)
    yield tmp_path, weights
    for name in [name for name in sys.modules if name.startswith("weir_toy_kinds")]:
        del sys.modules[name]


def reference_greedy(weights, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    from weir_toy_kinds.model import reference_logits

    tokens, logits = list(prompt), []
    for _ in range(NUM_TOKENS):
        step = reference_logits(weights, tokens)[-1]
        logits.append(step)
        tokens.append(int(step.argmax()))
    return tokens[len(prompt):], torch.stack(logits)


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16),  # prompts in several chunks
    dict(max_model_len=64, kv_cache_memory_bytes=24 * 4 * LATENT * 4),  # 23 usable blocks: preemption
], ids=["chunked_prefill", "preemption"])
def test_made_up_kinds_serve_through_the_unchanged_core(toy_checkpoint, options):
    path, weights = toy_checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, attention_backend="toy_mean,toy_sum",
              **options)
    runner = llm.engine.runner
    assert {kind: backend.name for kind, backend in runner.caches.backends.items()} == {
        "toy_mean": "toy_mean", "toy_sum": "toy_sum"}
    assert [group.layers[0].kind for group in runner.caches.groups] == ["toy_mean"]
    watch = watch_engine(llm)  # the allocators' invariants after every step
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(length)] for length in (3, 11, 19, 30, 7, 26)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    if "kv_cache_memory_bytes" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    for output, prompt in zip(outputs, prompts):
        expected_tokens, expected_logits = reference_greedy(weights, prompt)
        assert output.outputs[0].token_ids == expected_tokens
        logits = torch.stack(watch.logits[output.request_id][:NUM_TOKENS])
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert_nothing_held(llm)
