"""Shared fixtures (a tiny Llama checkpoint with a tokenizer, one engine over it), and the tiers.

Two tiers. A test is ``integration`` (``pytestmark = pytest.mark.integration`` for a whole
module, the decorator for one test) when it takes seconds to minutes because it runs something
whole:

- parity with transformers through the engine (``test_engine_parity``, ``test_qwen3_next``,
  ``weir.testing.check_model``);
- a real server: a ``weir serve`` process or uvicorn on a thread, reached over HTTP
  (``test_server_*`` but ``test_server_units``);
- the real default model (SmolLM2 from its GGUF);
- the example plugins as installed packages (``examples/``: entry points, models, backends);
- Triton kernels run by the interpreter in a subprocess (``helpers_triton``: each module's
  checks take seconds to tens of seconds there; on CUDA they are ``gpu`` tests).

Everything else is the unit tier (one module or layer against its reference or its torch
version, the engine on a tiny model for a few steps), which
``python3 -m pytest -q -m "not integration"`` runs in about a minute on two cores. CI and the
README's command run both tiers; a kernel's author runs its test module whole. A test that makes
the unit tier slow belongs in the other one. ``gpu`` tests need CUDA and are skipped elsewhere.
"""

from __future__ import annotations

import pytest

from helpers_models import make_tiny_llama, save_tiny_qwen3_config


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
    return save_tiny_qwen3_config(tmp_path_factory.mktemp("config_only_qwen3"))
