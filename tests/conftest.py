"""Shared fixtures: a tiny Llama checkpoint with a tokenizer, and one engine over it."""

from __future__ import annotations

import pytest

from helpers_models import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), with_tokenizer=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_path):
    from weir import LLM

    return LLM(str(tiny_llama_path), device="cpu", dtype="float32", max_model_len=256, block_size=4)
