"""Gated DeltaNet on CUDA: Weir's slot-indexed decode kernels and the ``gdn_fla`` backend.

The ``check_*`` functions compare the decode kernels (and the backend's decode path, which needs
no fla) with plain torch written here; they run on the CPU in Triton's interpreter (a subprocess,
see helpers_triton) and compiled on CUDA. The gpu-marked tests add Qwen3-Next shapes, fla's
prefill path against the torch backend, and a CUDA-graph replay of a decode step.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers_triton import TESTS_DIR, kernel_check_tests
from weir.linear_attention import GATED_DELTA_NET, GatedDeltaNetLayerSpec, LayerState, LinearAttentionMetadata

SMALL = GatedDeltaNetLayerSpec(layer_idx=0, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                               conv_kernel=4)
# Non-power-of-two head dims and a 3-tap conv: every mask of the kernels is exercised.
ODD = GatedDeltaNetLayerSpec(layer_idx=0, num_k_heads=1, num_v_heads=3, head_k_dim=12, head_v_dim=20,
                             conv_kernel=3)
QWEN3_NEXT = GatedDeltaNetLayerSpec(layer_idx=0, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                                    conv_kernel=4)
NUM_POOL_SLOTS = 6  # slots 0..5 for requests, slot 6 = padding slot
# Three real requests on scattered slots, then two CUDA-graph padding requests on the padding slot.
STATE_INDICES = [2, 0, 5, NUM_POOL_SLOTS, NUM_POOL_SLOTS]
NUM_REAL = 3
UNTOUCHED_SLOTS = [1, 3, 4]


def _kernels():
    from weir.plugins.attention import gdn_triton_kernels  # imports triton: only inside a check

    return gdn_triton_kernels


def _randn(*shape, device, dtype=torch.float32, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _gates(num_tokens, num_v_heads, device, dtype, seed):
    """g: fp32 log-decay in about [-1.5, 0]; beta in (0, 1) in the model dtype."""
    g = -F.softplus(_randn(num_tokens, num_v_heads, device=device, seed=seed)) * 0.5
    beta = torch.sigmoid(_randn(num_tokens, num_v_heads, device=device, seed=seed + 1)).to(dtype)
    return g, beta


def _assert_close(actual, expected, dtype):
    """fp32: rounding only (1e-5). bf16: one unit in the last place of the output."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = max(1.0, expected.float().abs().amax().item())
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)


def reference_conv_step(x, conv_state, weight):
    """x [B, D], conv_state [B, D, K] (gathered) -> (SiLU output [B, D], new state [B, D, K])."""
    window = torch.cat([conv_state[:, :, 1:], x[:, :, None].to(conv_state.dtype)], dim=-1)  # [B, D, K]
    acc = (window.float() * weight.float()).sum(-1)  # [B, D]
    return F.silu(acc).to(x.dtype), window


def reference_gdn_step(qkv, g, beta, state, layer):
    """qkv [B, conv_dim] conv output, state [B, HV, Dk, Dv] fp32 -> (out [B, HV, Dv], new state)."""
    num_reqs, group = qkv.shape[0], layer.num_v_heads // layer.num_k_heads
    q, k, v = qkv.float().split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.view(num_reqs, layer.num_k_heads, layer.head_k_dim).repeat_interleave(group, dim=1)  # [B, HV, Dk]
    k = k.view(num_reqs, layer.num_k_heads, layer.head_k_dim).repeat_interleave(group, dim=1)
    v = v.view(num_reqs, layer.num_v_heads, layer.head_v_dim)  # [B, HV, Dv]
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * layer.head_k_dim ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = state * g.exp()[:, :, None, None]
    predicted_v = (state * k[..., None]).sum(-2)  # [B, HV, Dv]
    correction = beta.float()[..., None] * (v - predicted_v)
    state = state + k[..., None] * correction[..., None, :]
    out = (state * q[..., None]).sum(-2)  # [B, HV, Dv]
    return out.to(qkv.dtype), state


def _conv_pool(layer, device, dtype, seed):
    return _randn(NUM_POOL_SLOTS + 1, layer.conv_dim, layer.conv_kernel, device=device, dtype=dtype, seed=seed)


def _recurrent_pool(layer, device, seed):
    shape = (NUM_POOL_SLOTS + 1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    return _randn(*shape, device=device, scale=0.3, seed=seed)


def _state_indices(device):
    return torch.tensor(STATE_INDICES, dtype=torch.int32, device=device)


def check_conv_decode_step(device, dtype=torch.float32, layers=(SMALL, ODD), block_d=32):
    for layer in layers:
        num_reqs, dim = len(STATE_INDICES), layer.conv_dim
        x = _randn(num_reqs, dim, device=device, dtype=dtype, seed=1)
        weight = _randn(dim, layer.conv_kernel, device=device, dtype=dtype, scale=0.5, seed=2)
        conv_state = _conv_pool(layer, device, dtype, seed=3)
        before = conv_state.clone()
        out = torch.empty(num_reqs, dim, dtype=dtype, device=device)
        slots = STATE_INDICES[:NUM_REAL]
        expected_out, expected_state = reference_conv_step(x[:NUM_REAL], before[slots], weight)

        _kernels().conv_decode_step(x, conv_state, weight, _state_indices(device), out, block_d=block_d)
        _assert_close(out[:NUM_REAL], expected_out, dtype)
        assert torch.equal(conv_state[slots], expected_state)  # pure data movement: exact
        assert torch.equal(conv_state[UNTOUCHED_SLOTS], before[UNTOUCHED_SLOTS])


def check_gdn_decode_step(device, dtype=torch.float32, layers=(SMALL, ODD), block_v=8):
    for layer in layers:
        num_reqs = len(STATE_INDICES)
        qkv = _randn(num_reqs, layer.conv_dim, device=device, dtype=dtype, seed=4)
        g, beta = _gates(num_reqs, layer.num_v_heads, device, dtype, seed=5)
        recurrent = _recurrent_pool(layer, device, seed=7)
        before = recurrent.clone()
        out = torch.empty(num_reqs, layer.num_v_heads, layer.head_v_dim, dtype=dtype, device=device)
        slots = STATE_INDICES[:NUM_REAL]
        expected_out, expected_state = reference_gdn_step(qkv[:NUM_REAL], g[:NUM_REAL], beta[:NUM_REAL],
                                                          before[slots], layer)

        _kernels().gdn_decode_step(qkv, g, beta, recurrent, _state_indices(device), out,
                                   num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim, block_v=block_v)
        _assert_close(out[:NUM_REAL], expected_out, dtype)
        _assert_close(recurrent[slots], expected_state, torch.float32 if dtype == torch.float32 else dtype)
        assert torch.equal(recurrent[UNTOUCHED_SLOTS], before[UNTOUCHED_SLOTS])


def _decode_metadata(num_reqs, device):
    return LinearAttentionMetadata(
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=device),
        state_indices=_state_indices(device)[:num_reqs], num_reqs=num_reqs, num_tokens=num_reqs,
        max_query_len=1,
    )


def check_backend_decode_steps(device, dtype=torch.float32, layer=SMALL):
    """Three decode steps through FlaGDNBackend (no fla needed) vs the torch references."""
    from weir.plugins.attention.gdn_fla import FlaGDNBackend

    backend = FlaGDNBackend(dtype, torch.device(device))
    num_reqs = len(STATE_INDICES)
    state = LayerState(conv_state=_conv_pool(layer, device, dtype, seed=8),
                       recurrent_state=_recurrent_pool(layer, device, seed=9))
    before = LayerState(state.conv_state.clone(), state.recurrent_state.clone())
    slots = STATE_INDICES[:NUM_REAL]
    expected_conv, expected_recurrent = state.conv_state[slots], state.recurrent_state[slots]
    weight = _randn(layer.conv_dim, layer.conv_kernel, device=device, dtype=dtype, scale=0.5, seed=10)
    metadata = backend.build_metadata(_decode_metadata(num_reqs, device))
    for step in range(3):
        mixed_qkv = _randn(num_reqs, layer.conv_dim, device=device, dtype=dtype, seed=11 + step)
        g, beta = _gates(num_reqs, layer.num_v_heads, device, dtype, seed=20 + 2 * step)
        out = backend.forward(layer, mixed_qkv, g, beta, weight, state, metadata)
        conv_out, expected_conv = reference_conv_step(mixed_qkv[:NUM_REAL], expected_conv, weight)
        expected_out, expected_recurrent = reference_gdn_step(conv_out, g[:NUM_REAL], beta[:NUM_REAL],
                                                              expected_recurrent, layer)
        assert out.shape == (num_reqs, layer.num_v_heads, layer.head_v_dim) and out.dtype == dtype
        _assert_close(out[:NUM_REAL], expected_out, dtype)
    assert torch.equal(state.conv_state[slots], expected_conv)
    _assert_close(state.recurrent_state[slots], expected_recurrent, torch.float32 if dtype == torch.float32 else dtype)
    assert torch.equal(state.conv_state[UNTOUCHED_SLOTS], before.conv_state[UNTOUCHED_SLOTS])
    assert torch.equal(state.recurrent_state[UNTOUCHED_SLOTS], before.recurrent_state[UNTOUCHED_SLOTS])


def check_gdn_decode_step_16bit_state(device):
    """A bfloat16 state pool (``linear_state_dtype``): the update runs in fp32 from the stored
    values and is rounded once, so the result is the fp32 step of the rounded state, rounded."""
    layer = SMALL
    num_reqs = len(STATE_INDICES)
    qkv = _randn(num_reqs, layer.conv_dim, device=device, dtype=torch.float32, seed=4)
    g, beta = _gates(num_reqs, layer.num_v_heads, device, torch.float32, seed=5)
    recurrent = _recurrent_pool(layer, device, seed=7).bfloat16()
    before = recurrent.clone()
    out = torch.empty(num_reqs, layer.num_v_heads, layer.head_v_dim, dtype=torch.float32, device=device)
    slots = STATE_INDICES[:NUM_REAL]
    expected_out, expected_state = reference_gdn_step(qkv[:NUM_REAL], g[:NUM_REAL], beta[:NUM_REAL],
                                                      before[slots].float(), layer)
    _kernels().gdn_decode_step(qkv, g, beta, recurrent, _state_indices(device), out,
                               num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim, block_v=8)
    _assert_close(out[:NUM_REAL], expected_out, torch.float32)
    assert recurrent.dtype == torch.bfloat16
    _assert_close(recurrent[slots], expected_state.bfloat16(), torch.bfloat16)
    assert torch.equal(recurrent[UNTOUCHED_SLOTS], before[UNTOUCHED_SLOTS])


def check_conv_prefill(device, dtype=torch.float32, layers=(SMALL, ODD)):
    """The varlen prefill conv against the torch conv per request: outputs (q and k normalised,
    each in its own buffer) and the new states, from strided input rows; other slots untouched."""
    from weir.plugins.attention.gdn_fla import chunk_indices_from_query_start_loc
    from weir.plugins.attention.gdn_torch_ops import causal_conv1d_with_state, l2_normalize
    from weir.plugins.attention.gdn_triton_prefill import conv_prefill

    # Two chunks of 64; requests shorter than the kernel (the new state keeps old taps); a single token.
    query_lens, slots = [70, 1, 2, 5], [2, 0, 5, 3]
    for layer in layers:
        num_tokens, dim = sum(query_lens), layer.conv_dim
        x = _randn(num_tokens, dim + 7, device=device, dtype=dtype, seed=70)[:, 3:3 + dim]  # strided rows
        weight = _randn(dim, layer.conv_kernel, device=device, dtype=dtype, scale=0.5, seed=71)
        conv_state = _conv_pool(layer, device, dtype, seed=72)
        before = conv_state.clone()
        cu_seqlens_cpu = np.array([0, *np.cumsum(query_lens)], dtype=np.int64)
        chunk_table = chunk_indices_from_query_start_loc(cu_seqlens_cpu, 64)
        strided_slots = torch.tensor([[slot, -1] for slot in slots], device=device)[:, 0]  # a column view
        q, k, v = conv_prefill(
            x, conv_state, weight, strided_slots, torch.tensor(cu_seqlens_cpu, device=device),
            torch.tensor(chunk_table, device=device), num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim,
            num_v_heads=layer.num_v_heads, head_v_dim=layer.head_v_dim, chunk_size=64)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        for request, slot in enumerate(slots):
            rows = slice(int(cu_seqlens_cpu[request]), int(cu_seqlens_cpu[request + 1]))
            out, expected_state = causal_conv1d_with_state(x[rows][None], before[slot][None], weight)
            expected_q, expected_k, expected_v = out[0].split([layer.key_dim, layer.key_dim, layer.value_dim], -1)
            heads_k = (layer.num_k_heads, layer.head_k_dim)
            _assert_close(q[rows], l2_normalize(expected_q.unflatten(-1, heads_k)).to(dtype), dtype)
            _assert_close(k[rows], l2_normalize(expected_k.unflatten(-1, heads_k)).to(dtype), dtype)
            _assert_close(v[rows], expected_v.unflatten(-1, (layer.num_v_heads, layer.head_v_dim)), dtype)
            assert torch.equal(conv_state[slot], expected_state[0]), f"request {request}"  # data movement: exact
        untouched = [slot for slot in range(NUM_POOL_SLOTS + 1) if slot not in slots]
        assert torch.equal(conv_state[untouched], before[untouched])


CHECKS = [check_conv_decode_step, check_gdn_decode_step, check_gdn_decode_step_16bit_state,
          check_backend_decode_steps, check_conv_prefill]


test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_gdn_triton_kernels", CHECKS)


def test_launchers_refuse_wrong_inputs():
    kernels = _kernels()
    layer = SMALL
    qkv = torch.zeros(2, layer.conv_dim)
    g = beta = torch.zeros(2, layer.num_v_heads)
    recurrent = torch.zeros(3, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    out = torch.empty(2, layer.num_v_heads, layer.head_v_dim)
    with pytest.raises(ValueError, match="state_indices must be int32"):
        kernels.gdn_decode_step(qkv, g, beta, recurrent, torch.zeros(2, dtype=torch.int64), out,
                                num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 recurrent_state"):
        kernels.gdn_decode_step(qkv, g, beta, recurrent.double(), torch.zeros(2, dtype=torch.int32), out,
                                num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim)
    with pytest.raises(ValueError, match="disagree"):
        kernels.conv_decode_step(qkv, torch.zeros(3, layer.conv_dim + 1, 4), torch.zeros(layer.conv_dim, 4),
                                 torch.zeros(2, dtype=torch.int32), qkv.clone())


def test_chunk_table_matches_fla_layout():
    from weir.plugins.attention.gdn_fla import chunk_indices_from_query_start_loc

    table = chunk_indices_from_query_start_loc(np.array([0, 130, 133, 200, 201], dtype=np.int32), 64)
    assert table.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [2, 1], [3, 0]]


def test_build_metadata_derives_varlen_tables_from_the_host_copy():
    from weir.plugins.attention.gdn_fla import FlaGDNBackend

    backend = FlaGDNBackend(torch.float32, torch.device("cpu"))
    query_start_loc = torch.tensor([0, 70, 71], dtype=torch.int32)
    metadata = backend.build_metadata(LinearAttentionMetadata(
        query_start_loc=query_start_loc, state_indices=torch.tensor([3, 1], dtype=torch.int32), num_reqs=2,
        num_tokens=71, max_query_len=70, query_start_loc_cpu=query_start_loc.clone(),
    ))
    assert metadata.cu_seqlens.dtype == torch.int64 and metadata.cu_seqlens.tolist() == [0, 70, 71]
    assert metadata.cu_seqlens_cpu.dtype == torch.int64 and metadata.cu_seqlens_cpu.device.type == "cpu"
    assert metadata.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0]]
    assert metadata.state_slots.dtype == torch.int64 and metadata.state_slots.tolist() == [3, 1]
    assert metadata.num_tokens == 71 and metadata.query_start_loc is query_start_loc

    assert metadata.num_decode_reqs == 0

    decode = backend.build_metadata(_decode_metadata(2, "cpu"))
    assert decode.cu_seqlens is None and decode.chunk_indices is None and decode.state_slots is None


def test_build_metadata_splits_off_the_leading_decodes():
    """Mixed steps: leading one-token requests go to the decode kernels; the varlen tables
    describe the rest from token 0 of their own slice. A one-token request after a longer one
    stays in the chunk part."""
    from weir.plugins.attention.gdn_fla import FlaGDNBackend

    backend = FlaGDNBackend(torch.float32, torch.device("cpu"))
    query_start_loc = torch.tensor([0, 1, 2, 72, 73], dtype=torch.int32)
    metadata = backend.build_metadata(LinearAttentionMetadata(
        query_start_loc=query_start_loc, state_indices=torch.tensor([5, 3, 1, 0], dtype=torch.int32), num_reqs=4,
        num_tokens=73, max_query_len=70, query_start_loc_cpu=query_start_loc.clone(),
    ))
    assert metadata.num_decode_reqs == 2
    assert metadata.cu_seqlens.tolist() == [0, 70, 71] and metadata.cu_seqlens_cpu.tolist() == [0, 70, 71]
    assert metadata.state_slots.tolist() == [1, 0]
    assert metadata.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0]]


def test_backend_declares_cuda_and_reports_missing_fla(monkeypatch):
    from weir.plugins.attention.gdn_fla import FlaGDNBackend

    assert FlaGDNBackend.name == "gdn_fla" and FlaGDNBackend.supports_cuda_graphs
    assert FlaGDNBackend.supports("cuda", {GATED_DELTA_NET})
    assert not FlaGDNBackend.supports("cpu", {GATED_DELTA_NET})
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla...` raise ImportError
    assert "fla-core" in FlaGDNBackend.unavailable_reason()


def test_importing_the_backend_imports_no_fla_and_no_cuda(tmp_path):
    # A stand-in fla that fails loudly if anything imports it, installed or not on this machine.
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("raise RuntimeError('fla was imported')\n")
    code = ("import sys, torch, weir.plugins.attention.gdn_fla; "
            "assert 'fla' not in sys.modules, 'fla imported'; "
            "assert not torch.cuda.is_initialized(), 'CUDA initialised'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], cwd=TESTS_DIR, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


# ---------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_kernels_at_qwen3_next_shapes(dtype):
    check_conv_decode_step("cuda", dtype, layers=(QWEN3_NEXT,), block_d=256)
    check_gdn_decode_step("cuda", dtype, layers=(QWEN3_NEXT,), block_v=32)
    check_backend_decode_steps("cuda", dtype, layer=QWEN3_NEXT)
    check_conv_prefill("cuda", dtype, layers=(QWEN3_NEXT,))


def _relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def _step_metadata(query_lens, slots, device):
    query_start_loc_cpu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    return LinearAttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device), state_indices=torch.tensor(slots, dtype=torch.int32,
                                                                                   device=device),
        num_reqs=len(query_lens), num_tokens=int(sum(query_lens)), max_query_len=max(query_lens),
        query_start_loc_cpu=query_start_loc_cpu,
    )


@pytest.mark.gpu
@needs_cuda
def test_fla_backend_matches_torch_backend_on_a_varlen_batch():
    pytest.importorskip("fla")
    from weir.plugins.attention.gdn_fla import FlaGDNBackend
    from weir.plugins.attention.gdn_torch import TorchGDNBackend

    device, dtype, layer = torch.device("cuda"), torch.bfloat16, QWEN3_NEXT
    backends = [FlaGDNBackend(dtype, device), TorchGDNBackend(dtype, device)]
    states = [backend.allocate_state(NUM_POOL_SLOTS, layer) for backend in backends]
    slots = [4, 0, 2, 5]
    weight = _randn(layer.conv_dim, layer.conv_kernel, device=device, dtype=dtype, scale=0.5, seed=30)
    # Four requests fed in chunks: a 1-token chunk behind a longer one (it stays in the chunk path),
    # then two leading 1-token requests beside two chunks (the mixed split), then decode steps.
    steps = [[80, 2, 40, 7], [70, 1, 37, 8], [1, 1, 30, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    for step, query_lens in enumerate(steps):
        num_tokens = sum(query_lens)
        mixed_qkv = _randn(num_tokens, layer.conv_dim, device=device, dtype=dtype, seed=31 + step)
        g, beta = _gates(num_tokens, layer.num_v_heads, device, dtype, seed=40 + 2 * step)
        outs = []
        for backend, state in zip(backends, states):
            metadata = backend.build_metadata(_step_metadata(query_lens, slots, device))
            outs.append(backend.forward(layer, mixed_qkv, g, beta, weight, state, metadata))
        fla_out, torch_out = outs
        assert fla_out.shape == torch_out.shape == (num_tokens, layer.num_v_heads, layer.head_v_dim)
        assert _relative_error(fla_out, torch_out) < 2e-2, f"step {step}"
        assert torch.equal(states[0].conv_state[slots], states[1].conv_state[slots]), f"step {step}"
        assert _relative_error(states[0].recurrent_state[slots], states[1].recurrent_state[slots]) < 2e-2
    unused = [slot for slot in range(NUM_POOL_SLOTS + 1) if slot not in slots]
    assert not states[0].conv_state[unused].any() and not states[0].recurrent_state[unused].any()


@pytest.mark.gpu
@needs_cuda
def test_decode_step_replays_in_a_cuda_graph():
    from weir.plugins.attention.gdn_fla import FlaGDNBackend

    device, dtype, layer = torch.device("cuda"), torch.bfloat16, QWEN3_NEXT
    backend = FlaGDNBackend(dtype, device)
    num_reqs = 4  # three requests and one padding request
    state = LayerState(conv_state=_conv_pool(layer, device, dtype, seed=50),
                       recurrent_state=_recurrent_pool(layer, device, seed=51))
    weight = _randn(layer.conv_dim, layer.conv_kernel, device=device, dtype=dtype, scale=0.5, seed=52)
    metadata = backend.build_metadata(_decode_metadata(num_reqs, device))
    mixed_qkv = _randn(num_reqs, layer.conv_dim, device=device, dtype=dtype, seed=53)
    g, beta = _gates(num_reqs, layer.num_v_heads, device, dtype, seed=54)
    real = STATE_INDICES[:NUM_REAL]

    def eager_from(current: LayerState):
        """The eager step on a copy of ``current``: (output, state after)."""
        copy = LayerState(current.conv_state.clone(), current.recurrent_state.clone())
        return backend.forward(layer, mixed_qkv, g, beta, weight, copy, metadata), copy

    eager_from(state)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(layer, mixed_qkv, g, beta, weight, state, metadata)
    for replay in range(2):
        if replay:  # new values in the captured input buffers must be picked up
            mixed_qkv.copy_(_randn(num_reqs, layer.conv_dim, device=device, dtype=dtype, seed=60))
            g.copy_(_gates(num_reqs, layer.num_v_heads, device, dtype, seed=61)[0])
        expected_out, expected_state = eager_from(state)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out[:NUM_REAL], expected_out[:NUM_REAL]), f"replay {replay}"
        assert torch.equal(state.conv_state[real], expected_state.conv_state[real])
        assert torch.equal(state.recurrent_state[real], expected_state.recurrent_state[real])
        assert math.isfinite(graph_out[:NUM_REAL].float().abs().sum().item())
