"""The pieces of the DeepSeek models checked against transformers' own functions: interleaved RoPE
(bit for bit), the softmax scale with YaRN's mscale, the indexer's rotate_half on its first dims,
and the routing fields refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from weir.layers.rotary import InterleavedRotaryEmbedding, RotaryEmbedding
from weir.plugins.models.deepseek_v3 import DeepseekMoE, mla_rotary, mla_softmax_scale

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def small_config(**overrides) -> DeepseekV3Config:
    options = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, max_position_embeddings=8192,
                   rope_parameters=YARN, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    return DeepseekV3Config(**{**options, **overrides})


def hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = hf_v3.DeepseekV3RotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(0))  # [1, T, rope_dim] each


def test_interleaved_rope_matches_transformers_bit_for_bit():
    config = small_config()
    positions = torch.tensor([0, 1, 5, 100, 4095, 8000])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 8, generator=generator)  # [T, H, rope_dim]
    k = torch.randn(6, 1, 8, generator=generator)
    rotary = mla_rotary(config, 8192, interleaved=True)
    assert isinstance(rotary, InterleavedRotaryEmbedding)
    rotary.materialize_buffers(torch.device("cpu"))
    ours_q, ours_k = rotary(positions, q, k)
    cos, sin = hf_cos_sin(config, positions)
    hf_q, hf_k = hf_v3.apply_rotary_pos_emb_interleave(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                                       cos, sin)  # [1, H, T, D]
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0].transpose(0, 1))
    # Not a rotate_half in disguise: the pairs differ.
    rotate_half = RotaryEmbedding(config, 8, 8192, rotary_dim=8)
    rotate_half.materialize_buffers(torch.device("cpu"))
    assert (rotate_half(positions, q, k)[0] - ours_q).abs().max() > 0.1


def test_rotate_half_rope_matches_transformers_on_leading_dims():
    """The V3.2 indexer's RoPE: rotate_half on the first qk_rope_head_dim dims of a longer head."""
    config = small_config()
    positions = torch.tensor([3, 64, 5000])
    q = torch.randn(3, 2, 16)
    rotary = mla_rotary(config, 8192, interleaved=False)
    rotary.materialize_buffers(torch.device("cpu"))
    ours, _ = rotary(positions, q[..., :8], q[:, :1, :8])
    cos, sin = hf_cos_sin(config, positions)
    hf, _ = hf_v3.apply_rotary_pos_emb(q[..., :8].transpose(0, 1).unsqueeze(0), q[:, :1, :8].transpose(0, 1)
                                       .unsqueeze(0), cos, sin)
    torch.testing.assert_close(ours, hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rope", [YARN, {**YARN, "mscale_all_dim": 0.7, "mscale": 0.9},
                                  {**YARN, "mscale_all_dim": 0}, {"rope_type": "default", "rope_theta": 10000.0}])
def test_softmax_scale_matches_transformers(rope):
    config = small_config(rope_parameters=rope)
    hf_scale = hf_v3.DeepseekV3Attention(config, 0).scaling
    assert mla_softmax_scale(config) == pytest.approx(hf_scale, rel=1e-12)


def test_the_real_v3_scale():
    """DeepSeek-V3's own rope (factor 40, mscale_all_dim 1): 192 ** -0.5 * 1.3689 ** 2."""
    config = small_config(qk_nope_head_dim=128, qk_rope_head_dim=64)
    assert mla_softmax_scale(config) == pytest.approx(0.13524, abs=1e-5)


def test_moe_on_every_other_layer_is_refused():
    from weir.plugins.models.deepseek_v3 import is_moe_layer

    assert [is_moe_layer(small_config(first_k_dense_replace=1), index) for index in range(3)] == [False, True, True]
    config = small_config(first_k_dense_replace=1)
    config.moe_layer_freq = 2
    with pytest.raises(ValueError, match="moe_layer_freq=2 is not supported"):
        is_moe_layer(config, 1)


@pytest.mark.parametrize("fields", [{"scoring_func": "softmax"}, {"topk_method": "greedy"}])
def test_other_routing_fields_are_refused(fields):
    config = small_config(moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5)
    for name, value in fields.items():
        setattr(config, name, value)
    with torch.device("meta"), pytest.raises(ValueError, match="sigmoid scoring with noaux_tc"):
        DeepseekMoE(config)
