"""``weir generate`` sizes the engine to its one prompt instead of the platform's KV default."""

from __future__ import annotations

from typer.testing import CliRunner

from weir.cli.generate_cmd import TEMPLATE_ALLOWANCE_TOKENS, sized_for_one_prompt
from weir.cli.main import app


def test_one_sequence_and_a_context_the_prompt_needs_capped_at_the_models(tiny_llama_path, config_only_qwen3):
    # The tiny checkpoints declare 512 positions: the wish (prompt + allowance + output) is capped.
    assert sized_for_one_prompt(str(tiny_llama_path), "hi", 16, {}) == {"max_num_seqs": 1, "max_model_len": 512}
    mine = {"max_model_len": 100, "max_num_seqs": 4}
    assert sized_for_one_prompt(str(tiny_llama_path), "hi", 16, mine) == mine


def test_the_wish_counts_utf8_bytes_of_the_prompt(monkeypatch):
    from weir import model_files

    monkeypatch.setattr(model_files, "model_context_length", lambda model: 1 << 20)
    options = sized_for_one_prompt("m", "héllo", 64, {})
    assert options["max_model_len"] == len("héllo".encode()) + TEMPLATE_ALLOWANCE_TOKENS + 64


def test_generate_runs_on_a_sized_engine(tiny_llama_path):
    result = CliRunner().invoke(app, ["generate", "ab", "--model", str(tiny_llama_path), "--raw",
                                      "--max-tokens", "4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "finish_reason=" in result.output
