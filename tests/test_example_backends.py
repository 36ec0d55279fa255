"""examples/weir-plugin-backends: the example third-party backends conform and serve a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers_models import make_tiny_qwen3_next
from weir import LLM, SamplingParams
from weir.testing import check_linear_attention_backend, check_moe_backend

pytestmark = pytest.mark.integration

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "weir-plugin-backends"


@pytest.fixture
def example(monkeypatch):
    """The example package importable (installed or not) and its plugin module loaded with Weir's."""
    import weir.plugin_manager

    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    from weir_plugin_backends import plugin

    load_plugins = weir.plugin_manager.load_plugins

    def with_example(*args, **kwargs):
        registry = load_plugins(*args, **kwargs)
        if "loop_moe" not in registry.moe_backends:  # not pip-installed here
            registry.register_module(plugin, "example_backends", "weir-plugin-backends")
        return registry

    monkeypatch.setattr(weir.plugin_manager, "load_plugins", with_example)
    return plugin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_example_backends_pass_the_conformance_checks(example, dtype):
    from weir_plugin_backends.gdn_naive import NaiveGDNBackend
    from weir_plugin_backends.moe_loop import LoopMoEBackend

    check_moe_backend(LoopMoEBackend(), dtype=dtype)
    check_linear_attention_backend(NaiveGDNBackend, dtype=dtype, state_dtype=dtype)


def test_the_example_backends_serve_qwen3_next(example, tmp_path):
    checkpoint = make_tiny_qwen3_next(tmp_path / "qwen3-next")
    prompts = [{"prompt_token_ids": list(range(5, 5 + length))} for length in (3, 17, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for label, options in (("built-in", {}), ("example", dict(moe_backend="loop_moe",
                                                                attention_backend="torch,gdn_naive"))):
        llm = LLM(str(checkpoint), device="cpu", max_num_batched_tokens=16, **options)  # chunked prefill
        if label == "example":
            runner = llm.llm_engine.runner
            assert runner.moe_backend.name == "loop_moe" and runner.caches.backends["gated_delta_net"].name == "gdn_naive"
        tokens[label] = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["example"] == tokens["built-in"]
