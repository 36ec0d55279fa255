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
