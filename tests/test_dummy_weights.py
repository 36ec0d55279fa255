"""``load_format="dummy"``: random weights made on the device from a config-only folder."""

from __future__ import annotations

import pytest
import torch

from helpers_models import TINY_VOCAB_SIZE
from weir.weights.dummy import DUMMY_HIGH, DUMMY_LOW, fill_dummy_weights


@pytest.fixture(scope="module")
def dummy_llm(config_only_qwen3):
    from weir import LLM

    return LLM(str(config_only_qwen3), load_format="dummy", device="cpu", max_model_len=128, block_size=4)


def test_dummy_load_generates_tokens(dummy_llm):
    from weir import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    outputs = dummy_llm.generate(["hello", {"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    for output in outputs:
        assert len(output.outputs[0].token_ids) == 6
        assert all(0 <= token < TINY_VOCAB_SIZE for token in output.outputs[0].token_ids)


def test_dummy_values_norms_and_ties(dummy_llm):
    model = dummy_llm.engine.runner.model
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert DUMMY_LOW <= param.min() and param.max() <= DUMMY_HIGH, name
            assert param.std() > DUMMY_HIGH / 4, name  # really random, not constant
    by_name = dict(model.named_parameters(remove_duplicate=False))
    assert by_name["lm_head.weight"] is by_name["model.embed_tokens.weight"]  # tie survives


def test_fill_dummy_weights_is_seeded():
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    fill_dummy_weights(layer, seed=1)
    first = [param.clone() for param in layer.parameters()]
    fill_dummy_weights(layer, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, layer.parameters()))
    assert torch.equal(layer[1].weight, torch.ones(8)) and torch.equal(layer[1].bias, torch.zeros(8))
    fill_dummy_weights(layer, seed=2)
    assert not torch.equal(first[0], layer[0].weight)


def test_dummy_ignores_a_real_checkpoint(tiny_llama_path):
    from weir import LLM

    llm = LLM(str(tiny_llama_path), load_format="dummy", device="cpu", max_model_len=64, block_size=4)
    weight = llm.engine.runner.model.model.embed_tokens.weight
    assert weight.abs().max() <= DUMMY_HIGH  # the checkpoint's weights are ~0.1 in scale


def test_config_only_without_dummy_says_no_checkpoint(config_only_qwen3):
    from weir import LLM

    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*load_format='dummy'"):
        LLM(str(config_only_qwen3), device="cpu", max_model_len=64)


def test_broken_checkpoint_keeps_the_reader_error(config_only_qwen3, tmp_path):
    from weir import LLM

    for file in config_only_qwen3.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no index naming them"):
        LLM(str(tmp_path), device="cpu", max_model_len=64)


def test_load_format_is_validated(config_only_qwen3):
    from weir.config import EngineArgs

    with pytest.raises(ValueError, match="load_format must be one of auto, dummy, safetensors, gguf, got 'random'"):
        EngineArgs(model=str(config_only_qwen3), load_format="random").create_config()
