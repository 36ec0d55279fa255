"""The gated-layer Triton kernels (weir.kernels.triton_gated) against their torch oracles: the gated
RMSNorm and the Gated DeltaNet gates, on the CPU in Triton's interpreter and compiled on CUDA."""

from __future__ import annotations

import torch

from helpers_triton import kernel_check_tests
from weir.kernels.dispatch import forced_torch_ops
from weir.layers.gates import delta_net_gates
from weir.layers.norm import GatedRMSNorm


def _randn(*shape, device, dtype, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:  # a few bf16 ulps: the interpreter truncates where CUDA rounds
        scale = expected.float().abs().amax().item()
        assert (actual.float() - expected.float()).abs().max().item() <= 4 * 2**-7 * scale


def check_gated_rms_norm(device: str) -> None:
    from weir.kernels.triton_gated import gated_rms_norm_triton

    for dtype in (torch.float32, torch.bfloat16):
        num_tokens, num_heads, head_dim = 5, 3, 24  # head_dim not a power of two: masked tail
        norm = GatedRMSNorm(head_dim, eps=1e-6).to(device)
        norm.weight.data = _randn(head_dim, device=device, dtype=dtype, seed=1) * 0.3 + 1
        x = _randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype, seed=2)
        # The gate is a strided view, as in the model (a column slice of one projection).
        projected = _randn(num_tokens, 2 * num_heads * head_dim + 7, device=device, dtype=dtype, seed=3)
        gate = projected[:, 7: 7 + num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        with forced_torch_ops():
            expected = norm(x, gate)
        _assert_close(gated_rms_norm_triton(x, gate, norm.weight, norm.eps), expected)


def check_delta_net_gates(device: str) -> None:
    from weir.kernels.triton_gated import delta_net_gates_triton

    for dtype in (torch.float32, torch.bfloat16):
        num_tokens, num_heads = 6, 5
        projected = _randn(num_tokens, 3 * num_heads, device=device, dtype=dtype, scale=8.0, seed=4)
        b, a = projected[:, num_heads: 2 * num_heads], projected[:, 2 * num_heads:]  # softplus both regimes
        a_log = _randn(num_heads, device=device, dtype=dtype, seed=5)
        dt_bias = _randn(num_heads, device=device, dtype=dtype, seed=6)
        with forced_torch_ops():
            expected_g, expected_beta = delta_net_gates(a, b, a_log, dt_bias)
        g, beta = delta_net_gates_triton(a, b, a_log, dt_bias)
        torch.testing.assert_close(g, expected_g, rtol=1e-5, atol=1e-5)
        _assert_close(beta, expected_beta)


CHECKS = [check_gated_rms_norm, check_delta_net_gates]

test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_gated_kernels", CHECKS)
