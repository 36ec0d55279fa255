"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from engine_harness import assert_nothing_held
from weir import LLM, SamplingParams


def test_prompt_longer_than_max_model_len(tiny_llm):
    with pytest.raises(ValueError, match=r"300 tokens.*max_model_len is 256"):
        tiny_llm.generate({"prompt_token_ids": [65] * 300}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert_nothing_held(tiny_llm)


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": []}, SamplingParams(), "prompt is empty"),
    ({"prompt_token_ids": [65, 100000]}, SamplingParams(), "100000 is outside the vocabulary"),
    ({"prompt_token_ids": ["a"]}, SamplingParams(), "list of integers"),
    (12, SamplingParams(), "string or a dict"),
    ("hi", SamplingParams(logprobs=50), "logprobs=50 is more than max_logprobs=20"),
    ("hi", SamplingParams(stop_token_ids=[99999]), "stop_token_ids entry 99999"),
])
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(tiny_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate([{"prompt_token_ids": [70, 71]}, prompt], params, use_tqdm=False)
    assert_nothing_held(tiny_llm)
    output = tiny_llm.generate("still serving", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 3


def test_max_tokens_is_clamped_to_the_context(tiny_llm):
    output = tiny_llm.generate({"prompt_token_ids": [65] * 250}, SamplingParams(max_tokens=100, ignore_eos=True),
                               use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 6 and output.outputs[0].finish_reason == "length"


def test_abort_frees_everything(tiny_llm):
    engine = tiny_llm.engine
    for index in range(4):
        engine.add_request(f"abort-{index}", {"prompt_token_ids": [66] * (10 + index)},
                           SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"abort-{index}" for index in range(4)])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(tiny_llm)


def test_unknown_engine_option():
    with pytest.raises(TypeError, match="unknown engine option.*max_batch"):
        LLM("whatever", max_batch=3)


def test_missing_model_path(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_unknown_architecture_lists_known_ones(tiny_llama_path, tmp_path):
    copy = shutil.copytree(tiny_llama_path, tmp_path / "foo")
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FooForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(copy), device="cpu")


def test_quantized_checkpoints_are_refused_by_name(tiny_llama_path, tmp_path, caplog):
    copy = shutil.copytree(tiny_llama_path, tmp_path / "fp8")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"fp8.*quantized checkpoint.*quant_method 'fp8'.*unquantized"):
        LLM(str(copy), device="cpu")
    # Random weights only need the shapes: a benchmark of a quantized release's config still runs.
    llm = LLM(str(copy), device="cpu", load_format="dummy", max_model_len=64)
    assert "quant_method 'fp8'" in caplog.text
    assert len(llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 2


def test_kv_cache_too_small_for_max_model_len(tiny_llama_path):
    with pytest.raises(ValueError, match=r"0 blocks of 16 tokens, fewer than one request of max_model_len=256 "
                                         r"needs \(16\)"):
        LLM(str(tiny_llama_path), device="cpu", max_model_len=256, kv_cache_memory_bytes=4096)
    # A budget of 5 blocks (the null one among them) holds 64 of the 256 tokens: the error says so,
    # and that max_model_len then starts.
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # 2 layers x (K, V) x 2 KV heads x 16 dims x 16 tokens, fp32
    with pytest.raises(ValueError, match=r"4 blocks of 16 tokens, fewer than one request of max_model_len=256 "
                                         r"needs \(16\) \(about max_model_len=64 fits\)"):
        LLM(str(tiny_llama_path), device="cpu", max_model_len=256, kv_cache_memory_bytes=5 * per_block)
    LLM(str(tiny_llama_path), device="cpu", max_model_len=64, kv_cache_memory_bytes=5 * per_block)


def test_invalid_engine_option_values(tiny_llama_path):
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        LLM(str(tiny_llama_path), max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype must be"):
        LLM(str(tiny_llama_path), dtype="int3")
    with pytest.raises(ValueError, match="max_model_len=9999 is longer"):
        LLM(str(tiny_llama_path), max_model_len=9999)


@pytest.mark.parametrize("option, value, message", [
    ("enable_prefix_caching", "false", "enable_prefix_caching must be a bool, got 'false'"),  # truthy!
    ("max_num_seqs", "4", "max_num_seqs must be an int or None"),
    ("max_model_len", True, "max_model_len must be an int or None, got True"),
    ("block_size", 2.5, "block_size must be an int, got 2.5"),
    ("gpu_memory_utilization", "0.5", "gpu_memory_utilization must be a float"),
    ("moe_backend", "nope", "moe_backend 'nope' is not registered; known: "),  # a dense model: never chosen
    ("attention_backend", "nope", "attention_backend 'nope' is not registered"),
    ("chat_template", "{{ bad", "chat_template has a Jinja syntax error at line 1"),
    ("chat_template", "/no/such/template.jinja", "neither a file that exists nor a Jinja template"),
])
def test_engine_options_of_the_wrong_kind_are_named(tiny_llama_path, option, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(tiny_llama_path), device="cpu", **{option: value})


def test_engine_options_take_paths_and_numpy_numbers(tiny_llama_path):
    import numpy as np

    llm = LLM(tiny_llama_path, device="cpu", max_model_len=np.int64(128), gpu_memory_utilization=np.float32(0.5))
    scheduler = llm.engine.config.scheduler
    assert scheduler.max_model_len == 128 and type(scheduler.max_model_len) is int
    assert llm.engine.config.model.model == str(tiny_llama_path)


def test_chat_template_from_a_file_or_inline(tiny_llama_path, tmp_path):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    for value in (str(tmp_path / "chat.jinja"), template):
        llm = LLM(str(tiny_llama_path), device="cpu", chat_template=value)
        assert llm.engine.config.model.chat_template == template


def test_unavailable_device(tiny_llama_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="cuda"):
        LLM(str(tiny_llama_path), device="cuda")


def test_attention_backend_lists_are_checked_name_by_name(tiny_llama_path):
    LLM(str(tiny_llama_path), device="cpu", attention_backend="torch,")  # a trailing comma names nothing
    with pytest.raises(ValueError, match="attention_backend 'flash' is not registered; known: gdn_fla"):
        LLM(str(tiny_llama_path), device="cpu", attention_backend="torch,flash")
