"""Shared layers against transformers: RoPE (every scaling type, partial rotary) and RMSNorm."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, Qwen3NextConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rope
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as partial_apply_rope

from helpers_models import ROPE_VARIANTS
from weir.layers import Fp32Linear, MergedLinear, QKVLinear, RMSNorm, RotaryEmbedding, rope_parameters_of

MAX_POSITIONS = 512
NUM_TOKENS, NUM_HEADS, NUM_KV_HEADS = 24, 4, 2


def _materialized_rope(hf_config, head_dim: int, dtype=torch.float32) -> RotaryEmbedding:
    with torch.device("meta"):  # as the loader builds models
        rope = RotaryEmbedding(hf_config, head_dim, MAX_POSITIONS)
    rope.to(dtype=dtype).to_empty(device="cpu")
    rope.materialize_buffers(torch.device("cpu"))
    return rope


def _random_qk(head_dim: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(NUM_TOKENS, NUM_HEADS, head_dim, generator=generator).to(dtype)
    k = torch.randn(NUM_TOKENS, NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
    # Positions past every variant's original_max_position_embeddings (128), below max (512).
    positions = torch.randint(0, MAX_POSITIONS, (NUM_TOKENS,), generator=generator)
    return positions, q, k


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_matches_transformers(variant):
    rope_parameters = {"rope_type": "default", **(ROPE_VARIANTS[variant] or {}), "rope_theta": 10000.0}
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                         max_position_embeddings=MAX_POSITIONS, rope_parameters=rope_parameters)
    positions, q, k = _random_qk(32)
    rope = _materialized_rope(config, 32)

    hf_rope = LlamaRotaryEmbedding(config)
    cos, sin = hf_rope(q, positions[None])  # [1, T, D]
    hf_q, hf_k = llama_apply_rope(q[None], k[None], cos, sin, unsqueeze_dim=2)  # [1, T, H, D]
    weir_q, weir_k = rope(positions, q, k)

    torch.testing.assert_close(weir_q, hf_q[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weir_k, hf_k[0], rtol=1e-6, atol=1e-6)
    if variant == "yarn":  # the attention factor must be folded into cos/sin
        assert rope.attention_scaling > 1.0


def test_scaled_rope_differs_from_plain_rope():
    # Guards the comparison above: the scaled variants must really change the rotation here.
    positions, q, k = _random_qk(32)
    outputs = {}
    for variant in ("default", "linear", "yarn", "llama3"):
        rope_parameters = {"rope_type": "default", **(ROPE_VARIANTS[variant] or {}), "rope_theta": 10000.0}
        config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                             max_position_embeddings=MAX_POSITIONS, rope_parameters=rope_parameters)
        outputs[variant] = _materialized_rope(config, 32)(positions, q, k)[0]
    for variant in ("linear", "yarn", "llama3"):
        assert (outputs[variant] - outputs["default"]).abs().max() > 1e-2, variant


def test_partial_rotary_matches_transformers():
    config = Qwen3NextConfig(hidden_size=64, num_attention_heads=NUM_HEADS, head_dim=32,
                             partial_rotary_factor=0.25, max_position_embeddings=MAX_POSITIONS)
    positions, q, k = _random_qk(32)
    rope = _materialized_rope(config, 32)
    assert rope.rotary_dim == 8

    cos, sin = Qwen3NextRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = partial_apply_rope(q[None], k[None], cos, sin, unsqueeze_dim=2)
    weir_q, weir_k = rope(positions, q, k)
    torch.testing.assert_close(weir_q, hf_q[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weir_k, hf_k[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weir_q[..., 8:], q[..., 8:], rtol=0, atol=0)


def test_rope_bf16_matches_transformers_rounding():
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                         max_position_embeddings=MAX_POSITIONS)
    positions, q, k = _random_qk(32, torch.bfloat16)
    rope = _materialized_rope(config, 32, torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.bfloat16
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # cast to bf16 like Weir's cache
    hf_q, _ = llama_apply_rope(q[None], k[None], cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(rope(positions, q, k)[0], hf_q[0], rtol=0, atol=0)


def test_rope_parameters_of_legacy_fields():
    legacy = types.SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5000.0,
                                   max_position_embeddings=64)
    assert rope_parameters_of(legacy) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    plain = types.SimpleNamespace(rope_theta=123.0, max_position_embeddings=64)
    assert rope_parameters_of(plain) == {"rope_type": "default", "rope_theta": 123.0}
    llama3 = types.SimpleNamespace(rope_scaling={"rope_type": "llama3", "factor": 8.0}, rope_theta=5e5,
                                   max_position_embeddings=64)
    assert rope_parameters_of(llama3)["original_max_position_embeddings"] == 64


def test_longrope_is_refused():
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
        "long_factor": [2.0] * 16, "original_max_position_embeddings": 128})
    with pytest.raises(ValueError, match="longrope"):
        RotaryEmbedding(config, 32, MAX_POSITIONS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=generator) * 0.2 + 1.0
    x = torch.randn(10, 64, generator=generator).to(dtype) * 3
    residual = torch.randn(10, 64, generator=generator).to(dtype)
    hf_norm = LlamaRMSNorm(64, eps=1e-5)
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
        norm.weight.copy_(weight)
    hf_norm.to(dtype)
    norm.to(dtype)

    torch.testing.assert_close(norm(x), hf_norm(x), rtol=0, atol=0)
    fused, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(fused, hf_norm(residual + x), rtol=0, atol=0)


def fp32_linear(device: str, bias: bool) -> Fp32Linear:
    layer = Fp32Linear(7168, 256, bias=bias).to(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(256, 7168, generator=generator) * 0.02)
        if bias:
            layer.bias.copy_(torch.randn(256, generator=generator))
        layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear_computes_in_float32_on_the_cpu(bias):
    layer = fp32_linear("cpu", bias)
    assert layer.split_weight is None  # the split halves are for CUDA's bf16 GEMMs
    x = torch.randn(5, 3, 7168).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (5, 3, 256)
    ref_bias = None if layer.bias is None else layer.bias.double()
    expected = torch.nn.functional.linear(x.double(), layer.weight.double(), ref_bias)
    # float32 accumulation over 7168 products; a bf16 weight or bf16 GEMM would be off by ~1e-3
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fp32_linear_bf16_halves_match_the_float32_gemm(bias):
    """A bf16 input on CUDA goes through the two bf16 halves of the weight: the float32 product to
    about 2**-16 of the output's scale, where one bf16 weight would be off by about 2**-9."""
    layer = fp32_linear("cuda", bias)
    assert layer.split_weight is not None and layer.split_weight.dtype == torch.bfloat16
    x = torch.randn(2, 150, 7168, device="cuda").to(torch.bfloat16)
    ref_bias = None if layer.bias is None else layer.bias.double()
    expected = torch.nn.functional.linear(x.double(), layer.weight.double(), ref_bias)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (2, 150, 256)
    error = float((out.double() - expected).abs().max() / expected.abs().max())
    one_half = torch.nn.functional.linear(x.float(), layer.weight.to(torch.bfloat16).float(), layer.bias)
    assert error < 2e-5, error
    assert float((one_half.double() - expected).abs().max() / expected.abs().max()) > 10 * error


def test_merged_linear_shards_and_split():
    qkv = QKVLinear(hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=3, bias=True)
    assert qkv.shard_ids == ("q", "k", "v")
    assert qkv.shard_slice("q") == slice(0, 12)
    assert qkv.shard_slice("k") == slice(12, 18)
    assert qkv.shard_slice("v") == slice(18, 24)
    merged = MergedLinear(4, {"gate": 5, "up": 5})
    with torch.no_grad():
        merged.weight.copy_(torch.arange(40.0).view(10, 4))
    gate, up = merged.split(merged(torch.ones(2, 4)))
    torch.testing.assert_close(gate[0], torch.arange(40.0).view(10, 4)[:5].sum(1))
    torch.testing.assert_close(up[0], torch.arange(40.0).view(10, 4)[5:].sum(1))
    with pytest.raises(KeyError, match="unknown shard"):
        merged.shard_slice("down")
