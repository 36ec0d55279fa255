"""The Triton layer kernels (weir.kernels.triton_layers) against the torch layers, their oracles.

Each ``check_*`` runs on the CPU in Triton's interpreter (a subprocess, see helpers_triton) and
compiled on CUDA (marked gpu). fp32 must agree to rounding; bf16 to one unit in the last place
(the interpreter truncates when it narrows to bf16, so it gets a looser bound than CUDA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from helpers_triton import kernel_check_tests
from weir.kernels.dispatch import forced_torch_ops
from weir.layers import GatedMLP, RMSNorm, RotaryEmbedding
from weir.layers.norm import ZeroCenteredRMSNorm

DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from weir.kernels import triton_layers  # imports triton: only inside a check

    return triton_layers


def _randn(*shape, device, dtype, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _assert_close(actual, expected, device):
    """fp32: rounding only. bf16: one ulp on CUDA (a few under the interpreter's truncation)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    ulp = 2**-7  # bf16's spacing relative to a value, at worst
    scale = expected.float().abs().amax().item()
    # Interpreted, each truncation can cost an ulp of the operands, which cancellation exposes.
    atol = ulp * scale * (0.1 if device == "cuda" else 3)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ulp if device == "cuda" else 3 * ulp, atol=atol)


def _norm(hidden, device, dtype, seed=0):
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) * 0.2 + 1.0)
    return norm.to(device=device, dtype=dtype)


def check_rms_norm(device):
    for dtype in DTYPES:
        for hidden in (64, 200):
            norm = _norm(hidden, device, dtype)
            x = _randn(37, hidden, device=device, dtype=dtype, scale=3.0, seed=1)
            with forced_torch_ops():
                expected = norm(x)
            _assert_close(_kernels().rms_norm_triton(x, norm.weight, norm.eps), expected, device)


def check_rms_norm_of_strided_heads(device):
    # Qwen3's q_norm: [tokens, heads, head_dim] views into a wider qkv row.
    for dtype in DTYPES:
        norm = _norm(32, device, dtype)
        qkv = _randn(9, 7 * 32 + 5, device=device, dtype=dtype, seed=2)
        q = qkv[:, 5:5 + 4 * 32].view(9, 4, 32)
        with forced_torch_ops():
            expected = norm(q)
        _assert_close(_kernels().rms_norm_triton(q, norm.weight, norm.eps), expected, device)


def check_rms_norm_adds_the_residual_in_place(device):
    for dtype in DTYPES:
        norm = _norm(96, device, dtype)
        x = _randn(21, 96, device=device, dtype=dtype, scale=3.0, seed=3)
        residual = _randn(21, 96, device=device, dtype=dtype, seed=4)
        with forced_torch_ops():
            expected, expected_residual = norm(x, residual)
        residual_before = residual.clone()
        out, new_residual = _kernels().rms_norm_triton(x, norm.weight, norm.eps, residual)
        assert new_residual.data_ptr() == residual.data_ptr()  # updated in place
        assert not torch.equal(residual, residual_before)
        if dtype == torch.float32 or device == "cuda":
            assert torch.equal(new_residual, expected_residual)
        _assert_close(new_residual, expected_residual, device)
        _assert_close(out, expected, device)


def check_silu_and_mul(device):
    for dtype in DTYPES:
        for intermediate in (40, 1500):  # 1500: two column blocks, the second partial
            gate_up = _randn(13, 2 * intermediate, device=device, dtype=dtype, scale=3.0, seed=5)
            expected = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            _assert_close(_kernels().silu_and_mul_triton(gate_up), expected, device)


def _rope(rotary_dim, device, dtype, head_dim=32):
    config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=512)
    rope = RotaryEmbedding(config, head_dim, 512, rotary_dim=rotary_dim)
    rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
    rope.materialize_buffers(torch.device(device))
    return rope


def check_rotary_in_place(device):
    num_tokens, num_heads, num_kv_heads, head_dim = 19, 8, 2, 32
    for dtype in DTYPES:
        for rotary_dim in (32, 16):  # full and partial rotary
            rope = _rope(rotary_dim, device, dtype)
            qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype, seed=6)
            q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
            k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
                num_tokens, num_kv_heads, head_dim)
            v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
            positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(7)).to(device)
            with forced_torch_ops():
                expected_q, expected_k = rope(positions, q, k)
            rotated_q, rotated_k = _kernels().rotary_triton(positions, q, k, rope.cos_sin_cache)
            assert rotated_q.data_ptr() == q.data_ptr() and rotated_k.data_ptr() == k.data_ptr()
            assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # v untouched
            if dtype == torch.float32 or device == "cuda":
                # Same roundings as torch, FMA contraction off: bit for bit.
                assert torch.equal(rotated_q, expected_q) and torch.equal(rotated_k, expected_k)
            _assert_close(rotated_q, expected_q, device)
            _assert_close(rotated_k, expected_k, device)


def check_interleaved_rotary_in_place(device):
    """DeepSeek's MLA layout: q_pe the last 16 of each head's 48 dims of a wider q, k_pe one head
    inside the kv latent's row; full and partial rotary dims."""
    from weir.layers.rotary import InterleavedRotaryEmbedding

    num_tokens, num_heads, nope, rope_dim, latent = 19, 8, 32, 16, 64
    config = LlamaConfig(hidden_size=256, num_attention_heads=num_heads, head_dim=rope_dim,
                         max_position_embeddings=512)
    for dtype in DTYPES:
        for rotary_dim in (rope_dim, rope_dim // 2):
            rope = InterleavedRotaryEmbedding(config, rope_dim, 512, rotary_dim=rotary_dim)
            rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
            rope.materialize_buffers(torch.device(device))
            q = _randn(num_tokens, num_heads, nope + rope_dim, device=device, dtype=dtype, seed=16)
            kv_a = _randn(num_tokens, latent + rope_dim, device=device, dtype=dtype, seed=17)
            q_nope_before, latent_before = q[..., :nope].clone(), kv_a[:, :latent].clone()
            q_pe, k_pe = q[..., nope:], kv_a[:, latent:].unsqueeze(1)
            positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(8)).to(device)
            with forced_torch_ops():
                expected_q, expected_k = rope(positions, q_pe, k_pe)
            rotated_q, rotated_k = _kernels().rotary_triton(positions, q_pe, k_pe, rope.cos_sin_cache,
                                                            interleaved=True)
            assert rotated_q.data_ptr() == q_pe.data_ptr() and rotated_k.data_ptr() == k_pe.data_ptr()
            assert torch.equal(q[..., :nope], q_nope_before) and torch.equal(kv_a[:, :latent], latent_before)
            if dtype == torch.float32 or device == "cuda":
                # Same roundings as torch, FMA contraction off: bit for bit.
                assert torch.equal(rotated_q, expected_q) and torch.equal(rotated_k, expected_k)
            _assert_close(rotated_q, expected_q, device)
            _assert_close(rotated_k, expected_k, device)


def _head_norm(norm_class, head_dim, device, dtype, seed):
    """A per-head q/k norm with random weights around identity (1 for RMSNorm, 0 zero-centred)."""
    norm = norm_class(head_dim, eps=1e-6)
    identity = 0.0 if norm_class is ZeroCenteredRMSNorm else 1.0
    with torch.no_grad():
        norm.weight.copy_(torch.randn(head_dim, generator=torch.Generator().manual_seed(seed)) * 0.2 + identity)
    return norm.to(device=device, dtype=dtype)


def _qkv_heads(num_tokens, num_heads, num_kv_heads, head_dim, device, dtype, seed, on_grid=None):
    """``(qkv, q, k)``: q and k are strided head views of one QKV GEMM output row per token.

    ``on_grid`` (default: for bf16) puts the values on a 1/32 grid, where the sum of squares is
    exact in any order: otherwise one fp32 ulp of the norm's statistics may flip a bf16 rounding,
    which RoPE's cancellation would magnify past the ulp rule. fp32 is checked to rounding.
    """
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=torch.float32,
                 scale=2.0, seed=seed)
    if on_grid or (on_grid is None and dtype == torch.bfloat16):
        qkv = (qkv * 32).round().clamp(-128, 128) / 32
    qkv = qkv.to(dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


def _check_qk_norm_rope(device, norm_class, num_heads, num_kv_heads, head_dim, rotary_dim):
    num_tokens = 19
    positions = torch.randperm(512, generator=torch.Generator().manual_seed(13))[:num_tokens].to(device)
    assert not torch.equal(positions, positions.sort().values)  # gathers must follow positions
    for dtype in DTYPES:
        rope = _rope(rotary_dim, device, dtype, head_dim=head_dim)
        q_norm = _head_norm(norm_class, head_dim, device, dtype, seed=14)
        k_norm = _head_norm(norm_class, head_dim, device, dtype, seed=15)
        qkv, q, k = _qkv_heads(num_tokens, num_heads, num_kv_heads, head_dim, device, dtype, seed=16)
        v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
        with forced_torch_ops():
            expected_q, expected_k = rope(positions, q_norm(q), k_norm(k))
        out_q, out_k = _kernels().qk_norm_rope_triton(
            positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, rope.cos_sin_cache, rotary_dim,
            zero_centered=norm_class is ZeroCenteredRMSNorm)
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
        assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # v untouched
        _assert_close(out_q, expected_q, device)
        _assert_close(out_k, expected_k, device)


def check_qk_norm_rope_qwen3(device):
    # Qwen3: RMSNorm per head, full rotary over head_dim 128, GQA 16/8.
    _check_qk_norm_rope(device, RMSNorm, num_heads=16, num_kv_heads=8, head_dim=128, rotary_dim=128)


def check_qk_norm_rope_zero_centered_partial(device):
    # Qwen3-Next: zero-centred norms, rotary over the first 64 of 256 dims, GQA 16/2.
    _check_qk_norm_rope(device, ZeroCenteredRMSNorm, num_heads=16, num_kv_heads=2, head_dim=256, rotary_dim=64)


def check_qk_norm_rope_matches_the_separate_kernels(device):
    # Bit for bit against rms_norm_triton then rotary_triton: on grid values the statistics are
    # exact, so any difference is a rounding step done differently. Odd shapes: head_dim 96
    # (not a power of two), a single kv head, rotary over 32 dims.
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim = 11, 5, 1, 96, 32
    positions = torch.randperm(512, generator=torch.Generator().manual_seed(23))[:num_tokens].to(device)
    for dtype in DTYPES:
        for norm_class in (RMSNorm, ZeroCenteredRMSNorm):
            zero_centered = norm_class is ZeroCenteredRMSNorm
            rope = _rope(rotary_dim, device, dtype, head_dim=head_dim)
            q_norm = _head_norm(norm_class, head_dim, device, dtype, seed=24)
            k_norm = _head_norm(norm_class, head_dim, device, dtype, seed=25)
            _, q, k = _qkv_heads(num_tokens, num_heads, num_kv_heads, head_dim, device, dtype, seed=26, on_grid=True)
            kernels = _kernels()
            expected_q, expected_k = kernels.rotary_triton(
                positions, kernels.rms_norm_triton(q, q_norm.weight, q_norm.eps, zero_centered=zero_centered),
                kernels.rms_norm_triton(k, k_norm.weight, k_norm.eps, zero_centered=zero_centered),
                rope.cos_sin_cache)
            out_q, out_k = kernels.qk_norm_rope_triton(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps,
                                                       rope.cos_sin_cache, rotary_dim, zero_centered=zero_centered)
            assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


def check_rotate_in_place_on_the_first_dims(device):
    """The lightning indexer's layout: RoPE on the first 16 of each head's 48 dims, q of 8 heads and
    k of one, rotated in place through views (the Triton kernel on CUDA, the torch result copied
    back elsewhere), rotate_half (DeepSeek-V3.2) and interleaved (GLM-5); the other dims untouched."""
    from weir.layers.rotary import InterleavedRotaryEmbedding

    num_tokens, num_heads, rope_dim, head_dim = 19, 8, 16, 48
    config = LlamaConfig(hidden_size=256, num_attention_heads=num_heads, head_dim=rope_dim,
                         max_position_embeddings=512)
    for dtype in DTYPES:
        for rope in (_rope(rope_dim, device, dtype, head_dim=rope_dim),
                     InterleavedRotaryEmbedding(config, rope_dim, 512, rotary_dim=rope_dim)):
            rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
            rope.materialize_buffers(torch.device(device))
            q = _randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype, seed=18)
            k = _randn(num_tokens, 1, head_dim, device=device, dtype=dtype, seed=19)
            q_before, k_before = q.clone(), k.clone()
            positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(9)).to(device)
            with forced_torch_ops():
                expected_q, expected_k = rope(positions, q[..., :rope_dim].contiguous(), k[..., :rope_dim].contiguous())
            rope.rotate_in_place(positions, q[..., :rope_dim], k[..., :rope_dim])
            assert torch.equal(q[..., rope_dim:], q_before[..., rope_dim:])
            assert torch.equal(k[..., rope_dim:], k_before[..., rope_dim:])
            assert not torch.equal(q[..., :rope_dim], q_before[..., :rope_dim])  # it did rotate
            # The torch path (CPU) does the same ops; the kernel (CUDA) rounds as torch does: bit for bit.
            assert torch.equal(q[..., :rope_dim], expected_q) and torch.equal(k[..., :rope_dim], expected_k)


CHECKS = [
    check_rms_norm,
    check_rms_norm_of_strided_heads,
    check_rms_norm_adds_the_residual_in_place,
    check_silu_and_mul,
    check_rotary_in_place,
    check_interleaved_rotary_in_place,
    check_rotate_in_place_on_the_first_dims,
    check_qk_norm_rope_qwen3,
    check_qk_norm_rope_zero_centered_partial,
    check_qk_norm_rope_matches_the_separate_kernels,
]

test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_layers_triton", CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_modules_dispatch_to_triton():
    dtype = torch.bfloat16
    norm = _norm(128, "cuda", dtype)
    x = _randn(8, 128, device="cuda", dtype=dtype, seed=8)
    residual = _randn(8, 128, device="cuda", dtype=dtype, seed=9)
    with forced_torch_ops():
        expected, expected_residual = norm(x, residual.clone())
    out, new_residual = norm(x, residual)
    assert new_residual.data_ptr() == residual.data_ptr()  # the fused kernel ran
    assert torch.equal(new_residual, expected_residual)
    _assert_close(out, expected, "cuda")

    mlp = GatedMLP(64, 96).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.1)
        hidden = _randn(5, 64, device="cuda", dtype=dtype, seed=10)
        with forced_torch_ops():
            expected_mlp = mlp(hidden)
        # The down projection mixes 96 products: an ulp in one activation moves the sum a little.
        torch.testing.assert_close(mlp(hidden).float(), expected_mlp.float(), rtol=0.02,
                                   atol=0.02 * expected_mlp.float().abs().amax().item())

    rope = _rope(32, "cuda", dtype)
    q = _randn(4, 8, 32, device="cuda", dtype=dtype, seed=11)
    k = _randn(4, 2, 32, device="cuda", dtype=dtype, seed=12)
    positions = torch.arange(4, device="cuda")
    with forced_torch_ops():
        expected_q, expected_k = rope(positions, q, k)
    rotated_q, rotated_k = rope(positions, q, k)
    assert rotated_q.data_ptr() == q.data_ptr()  # rotated in place: the kernel ran
    assert torch.equal(rotated_q, expected_q) and torch.equal(rotated_k, expected_k)


@pytest.mark.parametrize("norm_class, head_dim, rotary_dim", [(RMSNorm, 128, 128), (ZeroCenteredRMSNorm, 256, 64)])
def test_forward_with_norms_on_cpu_is_norm_then_rope(norm_class, head_dim, rotary_dim):
    rope = _rope(rotary_dim, "cpu", torch.bfloat16, head_dim=head_dim)
    q_norm = _head_norm(norm_class, head_dim, "cpu", torch.bfloat16, seed=17)
    k_norm = _head_norm(norm_class, head_dim, "cpu", torch.bfloat16, seed=18)
    qkv, q, k = _qkv_heads(7, 4, 2, head_dim, "cpu", torch.bfloat16, seed=19)
    qkv_before = qkv.clone()
    positions = torch.tensor([5, 0, 300, 2, 2, 511, 9])
    expected_q, expected_k = rope(positions, q_norm(q), k_norm(k))
    out_q, out_k = rope.forward_with_norms(positions, q, k, q_norm, k_norm)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert not torch.equal(out_q, q)  # it did normalise and rotate
    assert torch.equal(qkv, qkv_before)  # the torch path leaves the GEMM output alone


def test_fused_qk_norm_rope_takes_only_matching_norms():
    rope = _rope(32, "cpu", torch.bfloat16)
    q = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    rms, zero_centered = RMSNorm(32, eps=1e-6), ZeroCenteredRMSNorm(32, eps=1e-6)
    assert rope._norms_fit(q, rms.to(torch.bfloat16), RMSNorm(32, eps=1e-6).to(torch.bfloat16))
    assert rope._norms_fit(q, zero_centered, ZeroCenteredRMSNorm(32, eps=1e-6))  # fp32 weight: no promotion
    assert not rope._norms_fit(q, rms, RMSNorm(32, eps=1e-6))  # fp32 weight would promote bf16 q
    assert not rope._norms_fit(q, rms.to(torch.bfloat16), zero_centered.to(torch.bfloat16))  # mixed classes
    assert not rope._norms_fit(q, zero_centered, ZeroCenteredRMSNorm(32, eps=1e-5))  # different eps
    assert not rope._norms_fit(q, zero_centered, ZeroCenteredRMSNorm(16, eps=1e-6))  # not over head_dim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_with_norms_runs_the_fused_kernel():
    dtype = torch.bfloat16
    rope = _rope(64, "cuda", dtype, head_dim=256)
    q_norm = _head_norm(ZeroCenteredRMSNorm, 256, "cuda", dtype, seed=20)
    k_norm = _head_norm(ZeroCenteredRMSNorm, 256, "cuda", dtype, seed=21)
    _, q, k = _qkv_heads(5, 16, 2, 256, "cuda", dtype, seed=22)
    positions = torch.tensor([4, 1, 0, 77, 3], device="cuda")
    with forced_torch_ops():
        expected_q, expected_k = rope(positions, q_norm(q), k_norm(k))
    out_q, out_k = rope.forward_with_norms(positions, q, k, q_norm, k_norm)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # fused, in place
    _assert_close(out_q, expected_q, "cuda")
    _assert_close(out_k, expected_k, "cuda")
