"""Model plugins + loader against transformers: one prefill forward, logits compared in fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers_models import ROPE_VARIANTS, make_tiny_llama, make_tiny_qwen2, make_tiny_qwen3, tiny_model_config
from weir import LLM, SamplingParams
from weir.attention import AttentionMetadata
from weir.layer_cache import ForwardContext, LayerContext
from weir.plugins.attention.torch_ref import TorchAttentionBackend
from weir.plugins.models.llama import LlamaForCausalLM
from weir.plugins.models.qwen3 import Qwen3ForCausalLM
from weir.weights import iter_checkpoint
from weir.weights.loader import load_model
from weir.weights.safetensors_files import iter_safetensors

BLOCK_SIZE = 16
NUM_TOKENS = 40
CPU = torch.device("cpu")


def _load(model_cls, path: Path, dtype=torch.float32):
    config = tiny_model_config(path, dtype)
    return load_model(model_cls, config, CPU, iter_checkpoint(config))


def _weir_logits(model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One prefill of a single sequence through the torch reference attention backend."""
    num_tokens = input_ids.shape[0]
    num_blocks = (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    dtype = next(model.parameters()).dtype
    backend = TorchAttentionBackend(BLOCK_SIZE, dtype, CPU)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(num_tokens), num_reqs=1, num_tokens=num_tokens,
        max_query_len=num_tokens, max_seq_len=num_tokens)
    with torch.no_grad():
        layers = [LayerContext(backend, backend.allocate_kv_cache(num_blocks, spec), metadata)
                  for spec in model.attention_layers()]
        hidden = model(input_ids, positions, ForwardContext(layers))
        return model.compute_logits(hidden)  # [T, vocab]


def _hf_logits(path: Path, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(input_ids[None], position_ids=positions[None]).logits[0]


def _inputs(vocab_size: int, first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (NUM_TOKENS,), generator=generator)
    return input_ids, torch.arange(first_position, first_position + NUM_TOKENS)


def _assert_parity(model_cls, path: Path, first_position: int = 0) -> None:
    model = _load(model_cls, path)
    input_ids, positions = _inputs(model.model.embed_tokens.vocab_size, first_position)
    logits = _weir_logits(model, input_ids, positions)
    reference = _hf_logits(path, input_ids, positions)
    assert logits.shape == reference.shape
    relative_error = ((logits - reference).abs().max() / reference.abs().max()).item()
    assert relative_error < 1e-4, f"{model_cls.__name__}: max relative error {relative_error:.2e}"


@pytest.mark.parametrize("rope", sorted(ROPE_VARIANTS))
def test_llama_matches_transformers(tmp_path, rope):
    # Positions 300..339 lie past the scaled variants' original_max_position_embeddings (128).
    _assert_parity(LlamaForCausalLM, make_tiny_llama(tmp_path / "llama", rope=rope), first_position=300)


def test_llama_with_attention_bias_matches_transformers(tmp_path):
    _assert_parity(LlamaForCausalLM, make_tiny_llama(tmp_path / "llama", attention_bias=True, mlp_bias=True))


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_qwen3_matches_transformers(tmp_path, rope):
    _assert_parity(Qwen3ForCausalLM, make_tiny_qwen3(tmp_path / "qwen3", rope=rope), first_position=200)


@pytest.mark.integration
def test_qwen2_example_plugin_matches_transformers(tmp_path):
    # Installed by CI with `pip install -e examples/weir-plugin-qwen2 --no-deps`.
    from weir_plugin_qwen2.model import Qwen2ForCausalLM

    _assert_parity(Qwen2ForCausalLM, make_tiny_qwen2(tmp_path / "qwen2", num_hidden_layers=3))


@pytest.mark.integration
def test_qwen2_example_plugin_registers_through_its_entry_point():
    from weir.plugin_manager import load_plugins
    from weir_plugin_qwen2.model import Qwen2ForCausalLM

    registry = load_plugins(allowed=None)
    assert registry.models["Qwen2ForCausalLM"].distribution == "weir-plugin-qwen2"
    assert registry.resolve_model("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert registry.resolve_model("Qwen3ForCausalLM") is Qwen3ForCausalLM


def test_tied_lm_head_shares_the_embedding(tmp_path):
    model = _load(Qwen3ForCausalLM, make_tiny_qwen3(tmp_path / "qwen3"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    specs = model.attention_layers()
    assert [spec.layer_idx for spec in specs] == [0, 1]
    assert (specs[0].num_heads, specs[0].num_kv_heads, specs[0].head_dim) == (4, 2, 32)


def test_bf16_load_keeps_dtype_and_tracks_fp32(tmp_path):
    path = make_tiny_llama(tmp_path / "llama")
    model = _load(LlamaForCausalLM, path, torch.bfloat16)
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    input_ids, positions = _inputs(model.model.embed_tokens.vocab_size)
    logits = _weir_logits(model, input_ids, positions).float()
    reference = _hf_logits(path, input_ids, positions)
    assert ((logits - reference).abs().max() / reference.abs().max()).item() < 5e-2


def _rewrite_checkpoint(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_tiny_qwen3(tmp_path / "qwen3")
    _rewrite_checkpoint(path, lambda tensors: (tensors.pop("model.layers.1.mlp.up_proj.weight"),
                                               tensors.pop("model.layers.0.self_attn.k_norm.weight")))
    with pytest.raises(ValueError, match="lacks 2 tensor") as error:
        _load(Qwen3ForCausalLM, path)
    assert "model.layers.1.mlp.up_proj.weight" in str(error.value)
    assert "model.layers.0.self_attn.k_norm.weight" in str(error.value)


def test_unexpected_tensor_is_named(tmp_path):
    path = make_tiny_llama(tmp_path / "llama")
    _rewrite_checkpoint(path, lambda tensors: tensors.update({"model.layers.0.mlp.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.mlp\.extra\.weight"):
        _load(LlamaForCausalLM, path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    path = make_tiny_llama(tmp_path / "llama")
    _rewrite_checkpoint(path, lambda tensors: tensors.update(
        {"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(16, 64\).*expects \(32, 64\)"):
        _load(LlamaForCausalLM, path)


def test_ignored_and_tied_copies_are_skipped(tmp_path):
    path = make_tiny_qwen3(tmp_path / "qwen3")
    embedding = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    _rewrite_checkpoint(path, lambda tensors: tensors.update({
        "lm_head.weight": embedding.clone(),  # some tied checkpoints still store it
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}))
    _assert_parity(Qwen3ForCausalLM, path)


def test_a_rope_theta_that_is_not_a_number_is_named(tmp_path):
    path = make_tiny_llama(tmp_path / "llama")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": "x"}
    config.pop("rope_theta", None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_theta in the config must be a positive number, got 'x'"):
        _load(LlamaForCausalLM, path)


def test_a_tied_copy_that_differs_is_an_error(tmp_path):
    """transformers would use such a checkpoint's own lm_head; tying it silently changes outputs."""
    path = make_tiny_qwen3(tmp_path / "qwen3")
    embedding = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    _rewrite_checkpoint(path, lambda tensors: tensors.update({"lm_head.weight": embedding + 1}))
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight.*tie_word"):
        _load(Qwen3ForCausalLM, path)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
def test_a_tensor_that_is_not_a_16_or_32_bit_float_is_an_error(tmp_path, dtype):
    path = make_tiny_llama(tmp_path / "llama")
    _rewrite_checkpoint(path, lambda tensors: tensors.update({"model.norm.weight": torch.ones(64).to(dtype)}))
    with pytest.raises(ValueError, match=rf"model\.norm\.weight is {str(dtype).removeprefix('torch.')}"):
        _load(LlamaForCausalLM, path)


@pytest.mark.parametrize("damage, message", [
    (lambda file: file.write_bytes(file.read_bytes()[:-100]), "not a readable safetensors file"),
    (lambda file: file.write_bytes(b""), "not a readable safetensors file"),
    (lambda file: file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......"), "not a readable"),
])
def test_a_truncated_or_corrupt_safetensors_file_is_named(tmp_path, damage, message):
    path = make_tiny_llama(tmp_path / "llama")
    damage(path / "model.safetensors")
    with pytest.raises(ValueError, match=message) as error:
        _load(LlamaForCausalLM, path)
    assert str(path / "model.safetensors") in str(error.value)


@pytest.mark.parametrize("index, message", [
    ([1, 2], "must hold a JSON object"),
    ({"weight_map": {"model.norm.weight": 3}}, "weight_map values must be shard file names"),
    ({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}, "weight_map values must be shard file"),
])
def test_a_malformed_shard_index_is_named(tmp_path, index, message):
    path = make_tiny_llama(tmp_path / "llama")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message) as error:
        _load(LlamaForCausalLM, path)
    assert "model.safetensors.index.json" in str(error.value)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tmp_path):
    path = make_tiny_llama(tmp_path / "llama")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert sorted(name for name, _ in iter_safetensors(sharded)) == sorted(index["weight_map"])
    _assert_parity(LlamaForCausalLM, sharded)

    (sharded / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        iter_safetensors(sharded)


def test_folder_without_checkpoint_is_named(tmp_path):
    path = make_tiny_llama(tmp_path / "llama")
    empty = tmp_path / "empty"
    shutil.copytree(path, empty)
    (empty / "model.safetensors").rename(empty / "weights.safetensors")
    with pytest.raises(FileNotFoundError, match=r"empty.*model\.safetensors.*weights\.safetensors"):
        iter_checkpoint(tiny_model_config(empty))


def test_a_window_a_full_attention_model_would_ignore_is_refused(tmp_path):
    """Llama (unlike Mistral) has no sliding window: a Mistral/Phi-3 style scalar window with no
    layer_types is refused unless every sequence fits in it (Qwen3's windows, which transformers
    lists in layer_types, run: tests/test_granite_swa.py)."""
    path = make_tiny_llama(tmp_path / "model", sliding_window=64)
    with pytest.raises(ValueError, match=r"sliding_window=64 is not supported.*max_model_len <= 64"):
        LLM(str(path), device="cpu", max_model_len=128)


def test_a_window_switched_off_is_not_a_window(tmp_path):
    """Llama configs converted from Qwen2 keep its sliding_window with use_sliding_window false;
    transformers ignores the field then, and so does Weir."""
    path = make_tiny_llama(tmp_path / "llama", with_tokenizer=True, sliding_window=64, use_sliding_window=False)
    output = LLM(str(path), device="cpu", max_model_len=128).generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 2


def test_a_window_longer_than_max_model_len_runs_as_full_attention(tmp_path):
    path = make_tiny_llama(tmp_path / "llama", with_tokenizer=True, sliding_window=64)
    output = LLM(str(path), device="cpu", max_model_len=64).generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 2


def test_model_contract_gaps_are_named(tmp_path, monkeypatch):
    from weir.model_interface import check_model_class

    class NoSpecs(torch.nn.Module):
        def forward(self, input_ids, positions, ctx):
            return input_ids

        def compute_logits(self, hidden):
            return hidden

    with pytest.raises(TypeError, match=r"NoSpecs lacks attention_layers\(\), which every Weir model defines"):
        check_model_class(NoSpecs)

    # attention_layers() that leaves out a layer's attention module: named before any KV cache
    # index error could happen in a forward.
    path = make_tiny_llama(tmp_path / "llama")
    declared = LlamaForCausalLM.attention_layers
    monkeypatch.setattr(LlamaForCausalLM, "attention_layers", lambda self: declared(self)[:1])
    with pytest.raises(ValueError, match=r"attention_layers\(\) misses the attention modules of layers \[1\]"):
        LLM(str(path), device="cpu")
