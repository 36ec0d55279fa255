"""iter_gguf: a tiny llama GGUF written as llama.cpp writes one comes back as the HF weights.

``write_tiny_llama_gguf`` is also used by test_model_files.py and test_tokenizer.py.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from weir.config import EngineArgs
from weir.weights.gguf import iter_gguf

# Byte-level BPE vocabulary: the 256 byte symbols, two merges, then the ChatML specials.
MERGES = ["h e", "l l"]
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def gguf_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = list(bytes_to_unicode().values())
    return byte_symbols + [merge.replace(" ", "") for merge in MERGES] + SPECIAL_TOKENS


IM_START_ID = len(gguf_tokens()) - 2
IM_END_ID = len(gguf_tokens()) - 1


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves; this is its permutation."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.weight
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"


def write_tiny_llama_gguf(path: Path, *, tied: bool, quantize: bool = False, seed: int = 0,
                          replace: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Write a random 2-layer llama as a GGUF (with tokenizer and chat template metadata).

    Returns the HF state dict it was written from. ``quantize`` stores the 2-D weights as Q8_0.
    ``replace`` ({GGUF name: array}) writes these arrays instead of the model's, and adds the
    names the model does not have (to break a file on purpose).
    """
    replace = dict(replace or {})
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = gguf_tokens()
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    state = {name: tensor.clone() for name, tensor in LlamaForCausalLM(config).state_dict().items()}
    for name, tensor in state.items():
        if tensor.ndim == 1:  # norms away from 1, so a misplaced norm would show
            tensor.copy_(torch.randn_like(tensor) * 0.2 + 1.0)
    if tied:
        state.pop("lm_head.weight")

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(IM_START_ID)
    # SmolLM2's GGUF marks <|im_end|> as eos too; the default model's pinned id relies on that shape.
    writer.add_eos_token_id(IM_END_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    for hf_name, tensor in state.items():
        weights = tensor.numpy()
        if ".q_proj." in hf_name:
            weights = _llama_cpp_permute(weights, 4)
        elif ".k_proj." in hf_name:
            weights = _llama_cpp_permute(weights, 2)
        if _gguf_name(hf_name) in replace:
            writer.add_tensor(_gguf_name(hf_name), replace.pop(_gguf_name(hf_name)))
        elif quantize and weights.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(_gguf_name(hf_name), gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(hf_name), np.ascontiguousarray(weights))
    for gguf_name, weights in replace.items():
        writer.add_tensor(gguf_name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def model_config_for(path: Path, dtype: str = "float32"):
    return EngineArgs(model=str(path), dtype=dtype).create_config().model


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied") / "tiny-tied.gguf"
    return path, write_tiny_llama_gguf(path, tied=True)


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8") / "tiny-q8.gguf"
    return path, write_tiny_llama_gguf(path, tied=False, quantize=True, seed=1)


def transformers_gguf_tensors(path: Path, hf_config) -> dict[str, torch.Tensor]:
    """transformers' own GGUF dequantise-and-rename, the reference for iter_gguf."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta_model)["tensors"]


def test_f32_gguf_yields_the_original_hf_weights(tied_gguf):
    path, original = tied_gguf
    yielded = dict(iter_gguf(model_config_for(path)))
    # tied: the file has no output.weight, so no lm_head comes out
    assert set(yielded) == set(original)
    assert "lm_head.weight" not in yielded
    for name, tensor in original.items():
        assert yielded[name].dtype == torch.float32
        # q/k rows must come back un-permuted, exactly
        assert torch.equal(yielded[name], tensor), name


def test_quantized_gguf_matches_transformers_loader(quantized_gguf):
    path, original = quantized_gguf
    config = model_config_for(path)
    yielded = dict(iter_gguf(config))
    reference = transformers_gguf_tensors(path, config.hf_config)
    assert set(yielded) == set(reference) == set(original)  # untied: lm_head.weight included
    for name, tensor in yielded.items():
        assert torch.equal(tensor, reference[name].to(torch.float32)), name
        # Q8_0 keeps each weight within half a step of its 32-value block's scale
        tolerance = original[name].abs().max().item() / 127 + 1e-6
        assert torch.allclose(tensor, original[name], atol=tolerance, rtol=0), name


def test_tensors_come_out_in_the_configured_dtype(tied_gguf):
    path, original = tied_gguf
    yielded = dict(iter_gguf(model_config_for(path, dtype="bfloat16")))
    assert {tensor.dtype for tensor in yielded.values()} == {torch.bfloat16}
    embed = original["model.embed_tokens.weight"]
    assert torch.equal(yielded["model.embed_tokens.weight"], embed.to(torch.bfloat16))


def test_yielded_tensors_are_writable_copies(tied_gguf):
    path, _ = tied_gguf
    name, tensor = next(iter(iter_gguf(model_config_for(path))))
    tensor.add_(1.0)  # would raise on a read-only view of the memory-mapped file
    again = dict(iter_gguf(model_config_for(path)))[name]
    assert not torch.equal(tensor, again)


@pytest.mark.parametrize("config_class, gguf_arch", [
    ("LlamaConfig", "llama"), ("Qwen2Config", "qwen2"), ("Qwen3Config", "qwen3"),
    ("Qwen3MoeConfig", "qwen3moe"),
])
def test_name_map_equals_transformers_full_walk(config_class, gguf_arch):
    """The shortcut walk in weir.weights.gguf gives transformers' own GGUF -> HF name map."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map)

    from weir.weights.gguf import _gguf_to_hf_names

    hf_config = getattr(transformers, config_class)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2)
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=hf_config.to_dict())
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    expected = get_gguf_hf_weights_map(meta_model, processor)
    assert "blk.2.attn_q.weight" in expected
    assert _gguf_to_hf_names(hf_config, processor) == expected


@pytest.mark.parametrize("replace, message", [
    ({"blk.0.bogus.weight": np.ones(64, dtype=np.float32)}, "has no place for: blk.0.bogus.weight"),
    ({"output_norm.weight": np.ones(64, dtype=np.int32)}, "cannot dequantise tensor output_norm.weight of type I32"),
])
def test_a_gguf_tensor_the_model_cannot_take_is_named(tmp_path, replace, message):
    path = tmp_path / "broken.gguf"
    write_tiny_llama_gguf(path, tied=True, replace=replace)
    with pytest.raises(ValueError, match=message) as error:
        list(iter_gguf(model_config_for(path)))
    assert str(path) in str(error.value)


def test_rope_freqs_is_dropped_as_transformers_drops_it(tmp_path):
    path = tmp_path / "rope_freqs.gguf"
    state = write_tiny_llama_gguf(path, tied=True, replace={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    assert sorted(name for name, _ in iter_gguf(model_config_for(path))) == sorted(state)
