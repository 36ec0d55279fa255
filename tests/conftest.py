"""Shared fixtures: a tiny Llama checkpoint with a tokenizer, and one engine over it."""

from __future__ import annotations

import pytest

from helpers_models import _COMMON, make_tiny_llama, save_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), with_tokenizer=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_path):
    from weir import LLM

    return LLM(str(tiny_llama_path), device="cpu", dtype="float32", max_model_len=256, block_size=4)


@pytest.fixture(scope="session")
def config_only_qwen3(tmp_path_factory):
    """config.json + tokenizer, no weights: only loadable with ``load_format="dummy"``."""
    from transformers import Qwen3Config

    folder = tmp_path_factory.mktemp("config_only_qwen3")
    Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder
