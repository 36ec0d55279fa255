"""Loading DeepSeek-family checkpoints: MTP layers skipped with one log line, FP8 checkpoints
refused by name, the float32 parameters (router, correction bias, indexer head weights) kept
float32 in a bfloat16 model, shared experts moved into the experts, and the configs Weir does not
serve refused by name."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from helpers_models import make_tiny_deepseek_v3, make_tiny_deepseek_v32, make_tiny_glm_moe_dsa
from weir import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 77, 190, 3, 42, 8, 250, 19, 100]}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def edit_config(path, **fields) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(fields)
    config_file.write_text(json.dumps(config))


def test_mtp_layers_are_skipped_with_one_log_line(tmp_path, caplog):
    path = make_tiny_deepseek_v3(tmp_path / "plain", with_tokenizer=True)
    plain = LLM(str(path), device="cpu", dtype="float32", max_model_len=64)
    expected = plain.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    tensors = load_file(path / "model.safetensors")
    hidden, layer = 64, "model.layers.3"  # the tiny config has 3 decoder layers
    tensors.update({
        f"{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden), f"{layer}.enorm.weight": torch.ones(hidden),
        f"{layer}.hnorm.weight": torch.ones(hidden), f"{layer}.shared_head.head.weight": torch.randn(320, hidden),
        f"{layer}.self_attn.kv_a_proj_with_mqa.weight": torch.randn(40, hidden),
        f"{layer}.mlp.experts.0.gate_proj.weight": torch.randn(32, hidden),
    })
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    edit_config(path, num_nextn_predict_layers=1)
    with caplog.at_level(logging.INFO, logger="weir.plugins.models.deepseek_v3"):
        with_mtp = LLM(str(path), device="cpu", dtype="float32", max_model_len=64)
    mtp_lines = [record for record in caplog.records if "MTP" in record.getMessage()]
    assert len(mtp_lines) == 1 and "model.layers.3.* on" in mtp_lines[0].getMessage()
    assert with_mtp.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_a_v32_mtp_layer_and_its_indexer_are_skipped_with_one_log_line(tmp_path, caplog):
    from helpers_models import add_made_up_deepseek_mtp_weights

    path = make_tiny_deepseek_v32(tmp_path / "v32", with_tokenizer=True)
    expected = LLM(str(path), device="cpu", dtype="float32", max_model_len=64).generate(
        [PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    add_made_up_deepseek_mtp_weights(path)  # layer 3, self_attn.indexer.* among its tensors
    with caplog.at_level(logging.INFO, logger="weir.plugins.models.deepseek_v3"):
        with_mtp = LLM(str(path), device="cpu", dtype="float32", max_model_len=64)
    mtp_lines = [record.getMessage() for record in caplog.records if "MTP" in record.getMessage()]
    assert len(mtp_lines) == 1 and "DeepseekV32ForCausalLM" in mtp_lines[0] and "'mtp' loads them" in mtp_lines[0]
    assert with_mtp.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_the_mtp_pattern_matches_only_the_declared_mtp_layers():
    from weir.plugins.models.deepseek_v3 import mtp_layer_pattern

    pattern = re.compile(mtp_layer_pattern(61, 2))
    assert pattern.search("model.layers.61.eh_proj.weight") and pattern.search("model.layers.62.enorm.weight")
    for kept in ("model.layers.0.mlp.gate.weight", "model.layers.6.self_attn.q_a_proj.weight",
                 "model.layers.60.mlp.experts.3.up_proj.weight", "model.norm.weight", "model.layers.610.x",
                 "model.layers.63.eh_proj.weight"):
        assert not pattern.search(kept), kept


@pytest.mark.parametrize("num_mtp, extra_layer", [(0, 3), (1, 4), (1, 12)])
def test_a_layer_past_the_last_that_the_config_does_not_declare_is_refused(tmp_path, num_mtp, extra_layer):
    """Only the ``num_nextn_predict_layers`` MTP modules are skipped: a checkpoint layer past them
    means a config with too few layers, which must not serve a truncated model."""
    path = make_tiny_deepseek_v3(tmp_path, with_tokenizer=True)  # 3 decoder layers
    tensors = load_file(path / "model.safetensors")
    tensors[f"model.layers.{extra_layer}.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    edit_config(path, num_nextn_predict_layers=num_mtp)
    with pytest.raises(ValueError, match=rf"does not use.*model\.layers\.{extra_layer}\.input_layernorm"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=64)


def test_fp8_checkpoints_are_refused_by_name(tmp_path):
    path = make_tiny_deepseek_v3(tmp_path, with_tokenizer=True)
    edit_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="quantized checkpoint .*quant_method 'fp8'"):
        LLM(str(path), device="cpu", dtype="float32")


def test_router_and_indexer_weights_stay_float32_in_a_bfloat16_model(tmp_path):
    llm = LLM(str(make_tiny_deepseek_v32(tmp_path, with_tokenizer=True)), device="cpu", dtype="bfloat16",
              max_model_len=64)
    model = llm.engine.runner.model
    moe_layer, dense_layer = model.model.layers[1], model.model.layers[0]
    assert moe_layer.mlp.gate.weight.dtype == torch.float32
    assert moe_layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert moe_layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert moe_layer.self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert moe_layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert dense_layer.mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_shared_experts_live_in_the_experts(tmp_path):
    from safetensors import safe_open

    path = make_tiny_deepseek_v3(tmp_path, q_lora_rank=None, n_shared_experts=2, with_tokenizer=True)
    moe = LLM(str(path), device="cpu", dtype="float32", max_model_len=64).engine.runner.model.model.layers[2].mlp
    assert moe.shared_experts is None
    experts = moe.experts
    assert experts.gate_up_proj.shape[0] == 8 + 2 and experts.num_shared_experts == 2
    with safe_open(path / "model.safetensors", "pt") as checkpoint:
        prefix = "model.layers.2.mlp.shared_experts"
        gate, up = (checkpoint.get_tensor(f"{prefix}.{name}_proj.weight") for name in ("gate", "up"))
        down = checkpoint.get_tensor(f"{prefix}.down_proj.weight")  # [hidden, 2 * 32]
    second = slice(32, 64)  # the second shared expert: the second half of the shared MLP's width
    torch.testing.assert_close(experts.gate_up_proj[9], torch.cat([gate[second], up[second]]), atol=0, rtol=0)
    torch.testing.assert_close(experts.down_proj[9], down[:, second], atol=0, rtol=0)


def test_unserved_configs_are_refused_by_name(tmp_path):
    v32 = make_tiny_deepseek_v32(tmp_path / "v32", with_tokenizer=True)
    edit_config(v32, q_lora_rank=0)  # transformers itself refuses None for V3.2
    with pytest.raises(ValueError, match="DeepseekV32ForCausalLM needs q_lora_rank"):
        LLM(str(v32), device="cpu", dtype="float32")
    glm = make_tiny_glm_moe_dsa(tmp_path / "glm", with_tokenizer=True)
    edit_config(glm, indexer_types=["shared", "full", "full"])
    with pytest.raises(ValueError, match=r"layer 0 is 'shared' in indexer_types, but a shared layer reuses"):
        LLM(str(glm), device="cpu", dtype="float32")
    edit_config(glm, indexer_types=["full", "sparse", "full"])
    with pytest.raises(ValueError, match=r"indexer_types must name 'full' or 'shared' for each of the 3 layers"):
        LLM(str(glm), device="cpu", dtype="float32")


def test_glm_indexer_types_come_from_the_config():
    """transformers derives ``indexer_types`` from ``index_topk_freq`` / ``index_topk_pattern``;
    a config that has only those (a transformers too old to derive them) is refused by name,
    not served with every layer "full"."""
    from types import SimpleNamespace

    from weir.plugins.models.deepseek_v32 import GlmMoeDsaForCausalLM

    kinds = GlmMoeDsaForCausalLM.checked_indexer_types
    assert kinds(SimpleNamespace(num_hidden_layers=2)) == ["full", "full"]
    assert kinds(SimpleNamespace(num_hidden_layers=2, indexer_types=("full", "shared"))) == ["full", "shared"]
    for derived_from in (dict(index_topk_freq=4), dict(index_topk_pattern="FSSF")):
        with pytest.raises(ValueError, match=f"sets {next(iter(derived_from))} but no indexer_types"):
            kinds(SimpleNamespace(num_hidden_layers=4, indexer_types=None, **derived_from))


def test_keep_fp32_params_must_name_parameters():
    from weir.weights.loader import _keep_fp32_params

    class Listed(nn.Module):
        keep_fp32_params = ("weight", "bias", "scale")

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
            self.bias = None  # an optional parameter the config left out
            self.scale = 2.0  # not a parameter

    model = nn.Sequential(Listed())
    with pytest.raises(ValueError, match="Listed.keep_fp32_params names 'scale', which is not a parameter of 0"):
        _keep_fp32_params(model)
    Listed.keep_fp32_params = ("weight", "bias")
    _keep_fp32_params(model)
    assert model[0].weight.dtype == torch.float32 and model[0].bias is None


def test_random_weights_for_a_config_alone(tmp_path):
    """``load_format="dummy"``: no checkpoint read, the float32 parameters filled too."""
    path = make_tiny_deepseek_v32(tmp_path, with_tokenizer=True)
    (path / "model.safetensors").unlink()
    llm = LLM(str(path), device="cpu", dtype="bfloat16", load_format="dummy", max_model_len=64)
    router = llm.engine.runner.model.model.layers[2].mlp.gate
    assert router.weight.dtype == torch.float32 and torch.isfinite(router.weight).all()
    assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
