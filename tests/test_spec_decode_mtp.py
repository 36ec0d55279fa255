"""The target's own multi-token-prediction weights as a draft head (``method: mtp``), on tiny
checkpoints with made-up MTP weights of Qwen3-Next (``mtp.*``), DeepSeek-V3 and V3.2 (the module at
layer ``num_hidden_layers``; V3.2's sparse, its prompts past ``index_topk``): greedy tokens and logprobs equal to the engine without speculation
(Qwen3-Next's DeltaNet state keeps nothing of rejected drafts), a checkpoint without the weights
refused by name; and Qwen3-Next's first drafts equal to those of a reference built from
transformers' own Qwen3-Next layer with the same weights (DeepSeek's reference:
``test_spec_decode_mtp_deepseek``)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import assert_nothing_held
from helpers_models import (add_made_up_deepseek_mtp_weights, add_made_up_mtp_weights, make_tiny_deepseek_v3,
                            make_tiny_deepseek_v32, make_tiny_qwen3_next)
from test_spec_decode_engine import assert_same_completions, generate
from weir import LLM, SamplingParams

pytestmark = pytest.mark.integration

MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
# family -> (tiny checkpoint, its made-up MTP weights, why a bare checkpoint is refused)
FAMILIES = {
    "qwen3_next": (make_tiny_qwen3_next, add_made_up_mtp_weights, r"mtp\.fc\.weight"),
    "deepseek_v3": (make_tiny_deepseek_v3, add_made_up_deepseek_mtp_weights, r"model\.layers\.3\.eh_proj\.weight"),
    # transformers' V3.2 config declares no MTP module by default
    "deepseek_v32": (make_tiny_deepseek_v32, add_made_up_deepseek_mtp_weights, r"num_nextn_predict_layers is 0"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    make, add_mtp_weights, _ = FAMILIES[request.param]
    return add_mtp_weights(make(tmp_path_factory.mktemp(request.param), with_tokenizer=True))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return add_made_up_mtp_weights(make_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3_next_mtp"), with_tokenizer=True))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mtp_keeps_greedy_and_logprobs_exact(family_checkpoint, async_scheduling):
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (3, 17, 30, 41)] + [[9, 8, 7] * 9]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    options = dict(max_num_batched_tokens=16, block_size=4, async_scheduling=async_scheduling)
    _, want = generate(family_checkpoint, prompts, params, **options)
    llm, got = generate(family_checkpoint, prompts, params, MTP, **options)
    assert_same_completions(got, want)
    assert llm.engine.scheduler.spec.counters.num_draft_tokens > 0
    assert_nothing_held(llm)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path, family):
    make, _, missing = FAMILIES[family]
    path = make(tmp_path / "no_mtp", with_tokenizer=True)
    with pytest.raises(ValueError, match="MTP head.*" + missing):
        LLM(str(path), device="cpu", speculative_config=MTP)


def test_mtp_drafts_match_a_transformers_reference(checkpoint):
    """The first two drafts after a prompt, from Weir's head, against transformers' Qwen3-Next
    decoder layer carrying the ``mtp.layers.0`` weights (a one-layer model whose final norm is
    ``mtp.norm`` and whose LM head is the target's), fed ``mtp.fc`` of the normed embeddings and
    Weir's own target hidden states (the target itself is checked against transformers elsewhere)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen3NextForCausalLM

    llm = LLM(str(checkpoint), device="cpu", dtype="float32", speculative_config=MTP, async_scheduling=False)
    engine, runner = llm.engine, llm.engine.runner
    prompt = [random.Random(5).randrange(0, 256) for _ in range(13)]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # the whole prompt in one step, then proposing
    row = runner.table.row_of["r"]
    tokens = runner.table.token_ids.gpu[row, : len(prompt) + 3].tolist()
    sampled, weir_drafts = tokens[len(prompt)], tokens[len(prompt) + 1:]
    target_hidden = runner.last_hidden[: len(prompt)].float()  # [P, hidden], post-norm

    config = AutoConfig.from_pretrained(checkpoint)
    config.num_hidden_layers, config.layer_types, config.mlp_only_layers = 1, ["full_attention"], []
    reference = Qwen3NextForCausalLM(config).eval()
    weights = load_file(checkpoint / "mtp.safetensors")
    target = load_file(checkpoint / "model.safetensors")
    state = {name.replace("mtp.layers.0.", "model.layers.0."): t for name, t in weights.items()
             if name.startswith("mtp.layers.0.")}
    # transformers keeps the experts fused: gate_up_proj [E, 2 I, H], down_proj [E, H, I].
    experts = sorted({int(name.split(".")[5]) for name in state if ".mlp.experts." in name})
    prefix = "model.layers.0.mlp.experts."
    state[prefix + "gate_up_proj"] = torch.stack([
        torch.cat([state.pop(f"{prefix}{e}.gate_proj.weight"), state.pop(f"{prefix}{e}.up_proj.weight")])
        for e in experts])
    state[prefix + "down_proj"] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in experts])
    state["model.norm.weight"] = weights["mtp.norm.weight"]
    state["lm_head.weight"] = target["lm_head.weight"]
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and all(name.startswith("model.embed_tokens") for name in missing), missing
    embed = target["model.embed_tokens.weight"]

    def zero_centred_norm(x, weight, eps=config.rms_norm_eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)

    def mtp_inputs(next_tokens, hidden):
        embeds = zero_centred_norm(embed[next_tokens], weights["mtp.pre_fc_norm_embedding.weight"])
        return torch.cat([embeds, zero_centred_norm(hidden, weights["mtp.pre_fc_norm_hidden.weight"])],
                         dim=-1) @ weights["mtp.fc.weight"].T

    with torch.no_grad():
        inputs = mtp_inputs(torch.tensor(prompt[1:] + [sampled]), target_hidden)  # position p: token p + 1
        out = reference(inputs_embeds=inputs[None], output_hidden_states=True)
        first = int(out.logits[0, -1].argmax())
        own_hidden = out.hidden_states[-1][0, -1]  # after mtp.norm: the next pass's hidden
        inputs = torch.cat([inputs, mtp_inputs(torch.tensor([first]), own_hidden[None])])
        second = int(reference(inputs_embeds=inputs[None]).logits[0, -1].argmax())
    assert weir_drafts == [first, second]
    while engine.has_unfinished_requests():
        engine.step()
