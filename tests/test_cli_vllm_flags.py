"""vLLM command-line habits: the flags a vLLM user types either work or fail saying why."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from weir.cli.main import app
from weir.config import EngineArgs


def run(*args):
    return CliRunner().invoke(app, [str(arg) for arg in args])


def test_version():
    from weir import __version__

    result = run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"weir {__version__}"


@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size"])
def test_tensor_parallelism_other_than_one_is_a_clear_error(config_only_qwen3, flag):
    result = run("bench", "throughput", config_only_qwen3, "--load-format", "dummy", flag, "2",
                 "--input-len", "4", "--output-len", "2")
    assert result.exit_code == 1 and "tensor parallelism is not implemented yet" in result.output


def test_tp_one_and_vllm_spellings_run(config_only_qwen3, tmp_path):
    out = tmp_path / "result.json"
    result = run("bench", "throughput", "--model", config_only_qwen3, "-tp", "1", "--disable-log-requests",
                 "--load-format", "dummy", "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                 "--device", "cpu", "--output-json", out)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["output_tokens"] == 4


def test_model_given_twice_differently_is_refused(config_only_qwen3, tmp_path):
    result = run("bench", "throughput", config_only_qwen3, "--model", tmp_path, "--input-len", "4",
                 "--output-len", "2")
    assert result.exit_code != 0 and "differ" in result.output
    assert "MODEL or --model" in run("bench", "throughput", "--input-len", "4", "--output-len", "2").output


def test_load_format_safetensors_and_gguf_are_checked_against_the_checkpoint(tiny_llama_path, tmp_path):
    assert EngineArgs(model=str(tiny_llama_path), load_format="safetensors").create_config().model.load_format
    with pytest.raises(ValueError, match="load_format='gguf'.*checkpoint folder"):
        EngineArgs(model=str(tiny_llama_path), load_format="gguf").create_config()
    from test_gguf import write_tiny_llama_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_path, tied=True)
    with pytest.raises(ValueError, match="load_format='safetensors'.*gguf"):
        EngineArgs(model=str(gguf_path), load_format="safetensors").create_config()


def test_an_unknown_model_type_names_what_weir_serves(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k9", "architectures": ["K9ForCausalLM"]}))
    with pytest.raises(ValueError) as error:
        EngineArgs(model=str(tmp_path), load_format="dummy").create_config()
    message = str(error.value)
    assert "'kimi_k9'" in message and "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message
    assert "upgrade" not in message
