"""EAGLE and EAGLE-3 draft heads (checkpoints in the layout vLLM loads, random weights) on the
tiny Llama: greedy tokens and logprobs equal to the engine without speculation; the EAGLE head's
first drafts equal to a transformers-built reference with the same weights; EAGLE-3's drafts are
target ids through its d2t map; broken checkpoints are refused naming what is wrong."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import assert_nothing_held
from helpers_models import make_tiny_eagle
from test_spec_decode_engine import assert_same_completions, generate, repetitive_prompts
from weir import LLM, SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def eagle(tiny_llama_path, tmp_path_factory):
    return make_tiny_eagle(tmp_path_factory.mktemp("eagle"), tiny_llama_path)


@pytest.fixture(scope="module")
def eagle3(tiny_llama_path, tmp_path_factory):
    return make_tiny_eagle(tmp_path_factory.mktemp("eagle3"), tiny_llama_path, eagle3=True, aux_layers=[0, 1, 1])


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_keep_greedy_and_logprobs_exact(tiny_llama_path, eagle, eagle3, method, async_scheduling):
    prompts = repetitive_prompts(4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    options = dict(max_num_batched_tokens=24, block_size=4, async_scheduling=async_scheduling)
    _, want = generate(tiny_llama_path, prompts, params, **options)
    head = eagle if method == "eagle" else eagle3
    speculative = {"method": method, "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    llm, got = generate(tiny_llama_path, prompts, params, speculative, **options)
    assert_same_completions(got, want)
    assert llm.engine.scheduler.spec.counters.num_draft_tokens > 0
    assert_nothing_held(llm)


def _first_drafts(llm, prompt: list[int]):
    """(sampled token, drafts) right after the prompt's step, and the target's hidden states."""
    engine, runner = llm.engine, llm.engine.runner
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    row = runner.table.row_of["r"]
    tokens = runner.table.token_ids.gpu[row, : len(prompt) + 4].tolist()
    hidden = runner.last_hidden[: len(prompt)].float().clone()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens[len(prompt)], tokens[len(prompt) + 1:], hidden


def test_eagle_drafts_match_a_transformers_reference(tiny_llama_path, eagle):
    """transformers' Llama decoder layer with the head's weights, its input norm and the model's
    final norm taken out (the EAGLE layout has neither), fed ``fc([embed(next token), hidden])``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM

    llm = LLM(str(tiny_llama_path), device="cpu", dtype="float32", async_scheduling=False,
              speculative_config={"method": "eagle", "model": str(eagle), "num_speculative_tokens": 3})
    prompt = [random.Random(1).randrange(0, 256) for _ in range(11)]
    sampled, drafts, target_hidden = _first_drafts(llm, prompt)
    head = load_file(eagle / "model.safetensors")
    target = load_file(tiny_llama_path / "model.safetensors")
    config = AutoConfig.from_pretrained(eagle)
    reference = LlamaForCausalLM(config).eval()
    state = {name.replace("layers.0.", "model.layers.0."): t for name, t in head.items() if name.startswith("layers.")}
    state["lm_head.weight"] = target["lm_head.weight"]
    reference.load_state_dict(state, strict=False)
    reference.model.layers[0].input_layernorm = torch.nn.Identity()
    reference.model.norm = torch.nn.Identity()
    embed = target["model.embed_tokens.weight"]

    def inputs(tokens, hidden):
        return torch.cat([embed[tokens], hidden], dim=-1) @ head["fc.weight"].T

    expected = []
    with torch.no_grad():
        embeds = inputs(torch.tensor(prompt[1:] + [sampled]), target_hidden)
        for _ in range(3):
            out = reference(inputs_embeds=embeds[None], output_hidden_states=True)
            expected.append(int(out.logits[0, -1].argmax()))
            own = out.hidden_states[-1][0, -1]  # the head's output: the next pass's hidden
            embeds = torch.cat([embeds, inputs(torch.tensor([expected[-1]]), own[None])])
    assert drafts[:3] == expected


def test_eagle3_drafts_are_target_ids_of_its_draft_vocabulary(tiny_llama_path, eagle3):
    from safetensors.torch import load_file

    llm = LLM(str(tiny_llama_path), device="cpu", async_scheduling=False,
              speculative_config={"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": 3})
    _, drafts, _ = _first_drafts(llm, [3, 1, 4, 1, 5, 9, 2, 6])
    allowed = set(load_file(eagle3 / "model.safetensors")["t2d"].nonzero().flatten().tolist())
    assert set(drafts[:3]) <= allowed
    assert_nothing_held(llm)


def test_broken_eagle_checkpoints_are_refused(tiny_llama_path, eagle, eagle3, tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE-3 checkpoint"):
        LLM(str(tiny_llama_path), device="cpu", speculative_config={
            "method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not an EAGLE checkpoint"):
        LLM(str(tiny_llama_path), device="cpu", speculative_config={
            "method": "eagle", "model": str(eagle3), "num_speculative_tokens": 2})
    bad_layers = make_tiny_eagle(tmp_path / "bad", tiny_llama_path, eagle3=True, aux_layers=[0, 1, 7])
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(str(tiny_llama_path), device="cpu", speculative_config={
            "method": "eagle3", "model": str(bad_layers), "num_speculative_tokens": 2})


def test_an_eagle3_map_outside_the_target_vocabulary_is_refused(tiny_llama_path, eagle3, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "bad_d2t"
    shutil.copytree(eagle3, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["d2t"][5] = 10**6  # draft id 5 -> far past the tiny vocabulary
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"d2t\[5\].*outside the target's vocabulary"):
        LLM(str(tiny_llama_path), device="cpu", speculative_config={
            "method": "eagle3", "model": str(broken), "num_speculative_tokens": 2})
