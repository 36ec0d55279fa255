"""Weir's one-pass GGUF header reader, and the config and tokenizer built from what it read:
each the same as the gguf package and transformers give, and the file parsed once per start."""

from __future__ import annotations

import numpy as np
import pytest

from test_gguf import write_tiny_llama_gguf

from weir.weights.gguf_config import RENAMED_ONLY_ARCHITECTURES, hf_config_from_gguf
from weir.weights.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf_file") / "tiny-q8.gguf"
    write_tiny_llama_gguf(path, tied=False, quantize=True, seed=3)
    return path


def test_header_and_tensors_equal_the_gguf_packages_reader(quantized_file):
    from gguf import GGUFReader
    from transformers.integrations.ggml import _gguf_parse_value

    reader = GGUFReader(str(quantized_file))
    parsed = GGUFFile.read(quantized_file)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        values = [_gguf_parse_value(field.parts[index], field.types) for index in field.data]
        assert parsed.metadata[key] == (values if field.types[0] == 9 else values[0]), key
    arrays = parsed.tensor_arrays()
    assert [info.name for info, _ in arrays] == [tensor.name for tensor in reader.tensors]
    for (info, data), tensor in zip(arrays, reader.tensors):
        assert info.ggml_type == tensor.tensor_type and data.dtype == tensor.data.dtype
        assert np.array_equal(data, tensor.data), info.name


def _metadata_only_gguf(path, architecture: str, tied: bool):
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(12345.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(96)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((96, 64), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((96, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", sorted(RENAMED_ONLY_ARCHITECTURES))
@pytest.mark.parametrize("tied", [True, False])
def test_the_config_equals_transformers_own(tmp_path, architecture, tied):
    from transformers import AutoConfig

    path = _metadata_only_gguf(tmp_path / f"{architecture}.gguf", architecture, tied)
    built = hf_config_from_gguf(GGUFFile.read(path))
    expected = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert type(built) is type(expected)
    assert built.to_dict() == expected.to_dict()
    assert built.tie_word_embeddings is tied and built.rope_parameters["rope_theta"] == 12345.0


def test_the_tokenizer_equals_autotokenizers(quantized_file):
    from transformers import AutoTokenizer

    from weir.config import EngineArgs
    from weir.tokenizer import load_tokenizer

    model_config = EngineArgs(model=str(quantized_file)).create_config().model
    loaded = load_tokenizer(model_config)
    expected = AutoTokenizer.from_pretrained(quantized_file.parent, gguf_file=quantized_file.name,
                                             local_files_only=True)
    assert type(loaded) is type(expected)
    assert loaded.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()
    assert loaded.init_kwargs == expected.init_kwargs and loaded.chat_template == expected.chat_template


def test_an_engine_start_parses_the_file_once_and_never_with_the_slow_reader(quantized_file, monkeypatch):
    import gguf

    from weir import LLM, SamplingParams

    reads = []
    original = GGUFFile.read.__func__
    monkeypatch.setattr(GGUFFile, "read", classmethod(lambda cls, path: reads.append(path) or original(cls, path)))

    def slow_reader(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader parsed the file")

    monkeypatch.setattr(gguf, "GGUFReader", slow_reader)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", slow_reader)
    llm = LLM(str(quantized_file), device="cpu", max_model_len=64)
    assert reads == [quantized_file]
    output = llm.generate("ab", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_a_broken_file_is_an_error_naming_it(quantized_file, tmp_path, damage):
    data = quantized_file.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"NOPE" + data[4:] if damage == "magic" else data[:200])
    with pytest.raises(ValueError, match="broken.gguf"):
        GGUFFile.read(broken)


@pytest.mark.parametrize("config_class, gguf_arch, architecture", [
    ("LlamaConfig", "llama", "LlamaForCausalLM"), ("Qwen3Config", "qwen3", "Qwen3ForCausalLM"),
])
def test_weirs_model_names_the_gguf_tensors_as_transformers_model_does(config_class, gguf_arch, architecture):
    """iter_gguf takes the HF names from Weir's own model instead of importing transformers'."""
    from pathlib import Path

    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from weir.config import ModelConfig
    from weir.weights.gguf import _gguf_to_hf_names, _weir_checkpoint_names

    for tied in (True, False):
        hf_config = getattr(transformers, config_class)(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=tied, architectures=[architecture])
        model_config = ModelConfig(model="m", weights_path=Path("m.gguf"), tokenizer_path=Path("m.gguf"),
                                   architecture=architecture, hf_config=hf_config, dtype=torch.float32,
                                   max_model_len=64, eos_token_ids=(1,), served_model_name="m")
        processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=hf_config.to_dict())
        with torch.device("meta"):
            expected = get_gguf_hf_weights_map(AutoModelForCausalLM.from_config(hf_config), processor)
        names = _weir_checkpoint_names(model_config)
        assert names is not None and _gguf_to_hf_names(hf_config, processor, names) == expected
