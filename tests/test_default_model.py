"""The real built-in model: SmolLM2-135M-Instruct from its GGUF, against transformers."""

from __future__ import annotations

import pytest
import torch

from engine_harness import assert_nothing_held, hf_greedy_with
from weir import LLM, SamplingParams
from weir.default_model import DEFAULT_MODEL_EOS_TOKEN_ID, ensure_default_model
from weir.tokenizer import apply_chat_template

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu")


def test_greedy_answer_matches_transformers_and_names_paris(default_llm):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=32)
    answer = default_llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop" and answer.token_ids[-1] == DEFAULT_MODEL_EOS_TOKEN_ID

    gguf = ensure_default_model()
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    prompt_ids = apply_chat_template(default_llm.get_tokenizer(), QUESTION, None)
    expected, _ = hf_greedy_with(hf_model, prompt_ids, len(answer.token_ids))
    assert answer.token_ids == expected
    assert_nothing_held(default_llm)


def test_default_model_facts(default_llm):
    config = default_llm.engine.model_config
    assert config.architecture == "LlamaForCausalLM"
    assert config.eos_token_ids == (DEFAULT_MODEL_EOS_TOKEN_ID,)
    assert default_llm.get_tokenizer().convert_ids_to_tokens(DEFAULT_MODEL_EOS_TOKEN_ID) == "<|im_end|>"


def test_default_model_samples_with_low_temperature_and_stops(default_llm):
    defaults = default_llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.2, 0.5, 256)
    # What the README's curl examples get: no temperature, no max_tokens, the model's defaults.
    for seed in range(4):
        params = default_llm.get_default_sampling_params().clone(seed=seed)
        answer = default_llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
        assert "Paris" in answer.text and answer.finish_reason == "stop", (seed, answer.text)


def test_generation_config_none_drops_the_default_models_defaults():
    from weir.config import EngineArgs

    model_config = EngineArgs(generation_config="none").create_config().model
    assert model_config.sampling_defaults == ()
    assert dict(EngineArgs().create_config().model.sampling_defaults)["temperature"] == 0.2


def test_the_servers_chat_without_sampling_fields_answers_paris():
    from server_helpers import request
    from server_inprocess import serve_in_thread
    from weir.default_model import DEFAULT_MODEL_NAME

    with serve_in_thread(DEFAULT_MODEL_NAME, max_model_len=1024) as (port, _, _):
        status, reply = request("POST", port, "/v1/chat/completions", {"messages": QUESTION, "seed": 0})
    assert status == 200, reply
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert reply["choices"][0]["finish_reason"] == "stop"
