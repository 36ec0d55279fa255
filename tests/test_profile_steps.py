"""``benchmarks/profile_steps.py``'s ``--expert-spread`` on the CPU: how a tiny DeepSeek-V3's router
spreads one prefill's tokens over its experts, one line per MoE layer, and the engine left as found."""

from __future__ import annotations

import re

import pytest

from helpers_models import make_tiny_deepseek_v3, make_tiny_llama
from weir import LLM


def test_expert_spread_reports_every_moe_layer(tmp_path, capsys):
    from benchmarks.profile_steps import expert_spread

    checkpoint = make_tiny_deepseek_v3(tmp_path / "deepseek", max_position_embeddings=1024)
    llm = LLM(str(checkpoint), max_model_len=1024, skip_tokenizer_init=True)
    backend = llm.engine.runner.moe_backend
    num_moe_layers = sum(1 for module in llm.engine.runner.model.modules() if type(module).__name__ == "DeepseekMoE")
    expert_spread(llm, batch=32)
    lines = [line for line in capsys.readouterr().out.splitlines() if "MoE layer" in line]
    assert num_moe_layers and len(lines) == num_moe_layers
    for line in lines:
        match = re.search(r"busiest expert ([\d.]+)x the mean load, (\d+)/(\d+) experts used; 32 tokens touch (\d+) "
                          r"\(uniform routing: (\d+)\)", line)
        assert match, line
        busiest, used, experts, touched, uniform = float(match[1]), *map(int, match.groups()[1:])
        assert busiest >= 1.0 and 0 < touched <= used <= experts and 0 < uniform <= experts
    assert "route" not in vars(backend)  # the wrapper is gone again
    assert not llm.engine.has_unfinished_requests()


def test_expert_spread_refuses_a_dense_model(tmp_path):
    from benchmarks.profile_steps import expert_spread

    llm = LLM(str(make_tiny_llama(tmp_path / "llama")), skip_tokenizer_init=True)
    with pytest.raises(SystemExit, match="no MoE layers"):
        expert_spread(llm, batch=8)
