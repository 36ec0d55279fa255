"""DeepSeek-V3's and V3.2's next-token module as a draft head (``method: mtp``) on a tiny
checkpoint with a made-up layer at index ``num_hidden_layers``: the head's first draft equal to
transformers' ``MtpModel`` with the same weights, and its second (the one module chained on its
block's output before the head norm, as vLLM's ``deepseek_mtp`` chains it; transformers drafts one
token per module) equal to that module of transformers' chained so. V3.2's module is a sparse
layer with its own indexer, and the prompts run past ``index_topk``. GLM-5's module refused by
name. Greedy exactness and the refusal of a checkpoint without the weights:
``test_spec_decode_mtp``."""

from __future__ import annotations

import random

import pytest
import torch

from helpers_models import (add_made_up_deepseek_mtp_weights, make_tiny_deepseek_v3, make_tiny_deepseek_v32,
                            make_tiny_glm_moe_dsa)
from weir import LLM, SamplingParams

pytestmark = pytest.mark.integration

MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}


FAMILIES = {"deepseek_v3": make_tiny_deepseek_v3, "deepseek_v32": make_tiny_deepseek_v32}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = FAMILIES[request.param](tmp_path_factory.mktemp(request.param), with_tokenizer=True)
    return add_made_up_deepseek_mtp_weights(path)


def test_glm_moe_dsa_mtp_is_refused_by_name(tmp_path):
    path = add_made_up_deepseek_mtp_weights(make_tiny_glm_moe_dsa(tmp_path / "glm", with_tokenizer=True))
    with pytest.raises(ValueError, match="GlmMoeDsaForCausalLM has no multi-token-prediction head"):
        LLM(str(path), device="cpu", speculative_config=MTP)


def test_the_head_loads_its_indexer(checkpoint):
    """The module's indexer is built and loaded from the checkpoint's layer, not left empty."""
    from safetensors import safe_open

    llm = LLM(str(checkpoint), device="cpu", dtype="float32", speculative_config=MTP)
    attention = llm.engine.runner.spec.proposer.head.model.layers["3"].self_attn
    if type(llm.engine.runner.model).__name__ == "DeepseekV3ForCausalLM":
        assert attention.indexer is None  # V3's module is dense
        return
    with safe_open(checkpoint / "model-00002-of-00002.safetensors", "pt") as shard:
        for name in ("wk.weight", "weights_proj.weight", "k_norm.bias"):
            want = shard.get_tensor(f"model.layers.3.self_attn.indexer.{name}")
            assert torch.equal(attention.indexer.get_parameter(name), want), name


def test_mtp_drafts_match_a_transformers_reference(checkpoint, monkeypatch):
    import transformers
    from transformers.modeling_layers import MtpModel

    llm = LLM(str(checkpoint), device="cpu", dtype="float32", speculative_config=MTP, async_scheduling=False)
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(6)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (13, 5, 22, 9, 17, 30)]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # every prompt whole in one step, then proposing
    starts = [0]
    for prompt in prompts:
        starts.append(starts[-1] + len(prompt))
    cases = []
    for index, prompt in enumerate(prompts):
        row = runner.table.row_of[str(index)]
        tokens = runner.table.token_ids.gpu[row, : len(prompt) + 3].tolist()
        hidden = runner.last_hidden[starts[index]: starts[index + 1]].float()  # [P, hidden], post-norm
        cases.append((prompt, tokens[len(prompt)], tokens[len(prompt) + 1:], hidden))

    # MtpModel finds a checkpoint's MTP weights through the main model's ignore patterns, which
    # name layer 61 (the released checkpoints'); the tiny model's module is layer 3.
    main_cls = type(engine.runner.model).__name__
    monkeypatch.setattr(getattr(transformers, main_cls), "_keys_to_ignore_on_load_unexpected",
                        [r"model\.layers\.3\..*"])
    main = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    if main_cls == "DeepseekV32ForCausalLM":
        # transformers' V3.2 config maps no MTP layer: declare the checkpoint's one, a sparse MoE
        # block like the decoder's (MtpModel then builds it from the model's own layer classes).
        main.config.num_mtp_layers = 1
        main.config.mtp_layer_types = ["full_attention"]
        main.config.mtp_mlp_layer_types = ["sparse"]
    mtp = MtpModel.from_pretrained(main).float().eval()
    layer = mtp.layers[0]

    def block_outputs(input_ids, hidden):
        """The module over a whole sequence, as transformers drafts with it (position ids of the
        tokens it is fed): its block's output before the head norm [n, hidden]."""
        positions = torch.arange(1, len(input_ids) + 1)[None]
        layer.use_post_norm = False  # the chained hidden is taken before it
        try:
            return mtp.forward_layer(0, hidden[None], positions, None, input_ids=torch.tensor(input_ids)[None])[0]
        finally:
            layer.use_post_norm = True

    def draft(block_output):
        return int(mtp._project_to_logits(layer.post_norm(block_output)).argmax())

    with torch.no_grad():
        for prompt, sampled, weir_drafts, target_hidden in cases:
            inputs = prompt[1:] + [sampled]  # position p: the token at p + 1
            out = block_outputs(inputs, target_hidden)
            first = draft(out[-1])
            # transformers' own draft (head norm included) agrees with the reference's first
            drafted, _, _ = mtp(torch.tensor(inputs)[None], target_hidden[None], None,
                                torch.arange(1, len(inputs) + 1)[None], None)
            assert int(drafted[0, 0]) == first
            chained = block_outputs(inputs + [first], torch.cat([target_hidden, out[-1:]]))
            assert weir_drafts == [first, draft(chained[-1])]
    while engine.has_unfinished_requests():
        engine.step()
