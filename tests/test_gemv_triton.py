"""Weir's skinny GEMM (``weir.kernels.triton_gemv``) against ``x @ W.T``: interpreted on the CPU
in CI, compiled on the GPU (marked gpu); and ``Linear`` sending one-row inputs to it on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers_triton import kernel_check_tests


def check_gemv_shapes_and_tiles(device: str) -> None:
    from weir.kernels.triton_gemv import gemv

    generator = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cases = [  # (rows, out_features, in_features, tiles): ragged N and K, several rows, both tile kinds
        (1, 40, 96, (8, 32, 4)), (1, 64, 64, (16, 64, 4)), (1, 33, 100, (4, 32, 4)), (3, 48, 80, (16, 32, 4)),
        (1, 72, 2048, None), (1, 16500, 64, None),
    ]
    for rows, out_features, in_features, tiles in cases:
        x = torch.randn(rows, in_features, generator=generator).to(device, dtype)
        weight = torch.randn(out_features, in_features, generator=generator).to(device, dtype)
        expected = x.double() @ weight.double().T
        got = gemv(x, weight, tiles)
        assert got.shape == (rows, out_features) and got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        error = ((got.double() - expected).abs().max() / expected.abs().max()).item()
        assert error < tolerance, (rows, out_features, in_features, tiles, error)
    # A strided row (a slice of a wider activation) reads the right elements.
    wide = torch.randn(2, 2 * 96, generator=generator).to(device, dtype)
    weight = torch.randn(40, 96, generator=generator).to(device, dtype)
    row = wide[:1, ::2]
    assert torch.allclose(gemv(row, weight, (8, 32, 4)).double(), row.double() @ weight.double().T,
                          rtol=1e-2, atol=1e-2 if dtype != torch.float32 else 1e-6)


CHECKS = [check_gemv_shapes_and_tiles]

test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_gemv_triton", CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_linear_sends_one_row_to_the_gemv_and_more_rows_to_cublas(monkeypatch):
    from weir.kernels import dispatch
    from weir.layers.linear import Linear

    layer = Linear(512, 4096).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    calls = []
    gemv_module = dispatch.triton_module("triton_gemv")
    original = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    for shape in ((1, 512), (1, 1, 512), (4, 512)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=2e-2, atol=2e-2)
    assert len(calls) == 2  # the two one-row inputs
