"""The torch Kimi Delta Attention backend, its ops and Kimi Linear's gates and output norm against
transformers' torch fallbacks (CPU, fp32); the KDA contract's state layout; backend selection;
and weir.testing's linear-attention check held to KDA backends."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import (
    KimiLinearRMSNormGated,
    causal_conv1d_fn,
    chunk_kimi_delta_attention,
    l2norm,
    recurrent_kimi_delta_attention,
)

from weir.layers.gates import kimi_delta_gate
from weir.layers.norm import SigmoidGatedRMSNorm
from weir.linear_attention import KimiDeltaAttentionLayerSpec, LinearAttentionMetadata
from weir.plugins.attention.kda_torch import TorchKDABackend
from weir.plugins.attention.kda_torch_ops import chunk_kda, l2_normalize, recurrent_kda
from weir.testing import check_linear_attention_backend

LAYER = KimiDeltaAttentionLayerSpec(layer_idx=0, num_heads=2, head_dim=16, conv_kernel=4)
NUM_SLOTS = 6  # slot 6 is the padding slot
TOLERANCE = 1e-5


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _rule_inputs(seq_len: int, with_state: bool, seed: int = 0, batch: int = 2):
    generator = torch.Generator().manual_seed(seed)
    heads, dim = LAYER.num_heads, LAYER.head_dim
    q = torch.randn(batch, seq_len, heads, dim, generator=generator)
    k = torch.randn(batch, seq_len, heads, dim, generator=generator)
    v = torch.randn(batch, seq_len, heads, dim, generator=generator)
    # Decays from ~0.9 to ~1 per channel: state from far back still counts.
    g = F.logsigmoid(torch.randn(batch, seq_len, heads, dim, generator=generator) + 3)
    beta = torch.sigmoid(torch.randn(batch, seq_len, heads, generator=generator))
    state = torch.randn(batch, heads, dim, dim, generator=generator) if with_state else None
    return q, k, v, g, beta, state


# --- the delta rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("seq_len", [1, 7, 64, 100, 130])
def test_rule_matches_transformers(seq_len, with_state):
    q, k, v, g, beta, state = _rule_inputs(seq_len, with_state)
    hf_kwargs = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected_chunk = chunk_kimi_delta_attention(q, k, v, **hf_kwargs)
    expected_recurrent = recurrent_kimi_delta_attention(q, k, v, **hf_kwargs)
    for ours, expected in [(chunk_kda(q, k, v, g, beta, initial_state=state), expected_chunk),
                           (recurrent_kda(q, k, v, g, beta, initial_state=state), expected_recurrent)]:
        out, final_state = ours
        assert out.shape == (2, seq_len, LAYER.num_heads, LAYER.head_dim)
        assert final_state.dtype == torch.float32
        assert _relative_error(out, expected[0]) < TOLERANCE
        assert _relative_error(final_state, expected[1]) < TOLERANCE


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 200])
def test_chunked_rule_equals_the_recurrent_one(seq_len):
    q, k, v, g, beta, state = _rule_inputs(seq_len, with_state=True, seed=2)
    chunk_out, chunk_state = chunk_kda(q, k, v, g, beta, initial_state=state)
    recurrent_out, recurrent_state = recurrent_kda(q, k, v, g, beta, initial_state=state)
    assert _relative_error(chunk_out, recurrent_out) < TOLERANCE
    assert _relative_error(chunk_state, recurrent_state) < TOLERANCE


def test_decay_is_per_channel():
    """A channel that forgets (g = -inf) drops only its own row of the state."""
    q, k, v, g, beta, state = _rule_inputs(1, with_state=True, seed=4, batch=1)
    g = torch.zeros_like(g)
    g[..., 3] = float("-inf")
    beta = torch.zeros_like(beta)  # no write: the state after the step is the decayed one
    _, final_state = recurrent_kda(q, k, v, g, beta, initial_state=state)
    assert torch.equal(final_state[:, :, 3], torch.zeros_like(final_state[:, :, 3]))
    others = [row for row in range(LAYER.head_dim) if row != 3]
    assert torch.equal(final_state[:, :, others], state[:, :, others])


@pytest.mark.parametrize("split", [1, 64, 70, 129])
def test_state_carried_across_calls_equals_one_long_call(split):
    q, k, v, g, beta, _ = _rule_inputs(150, with_state=False, seed=3)
    whole_out, whole_state = chunk_kda(q, k, v, g, beta)
    first_out, state = chunk_kda(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split])
    rule = recurrent_kda if 150 - split == 1 else chunk_kda
    second_out, state = rule(q[:, split:], k[:, split:], v[:, split:], g[:, split:], beta[:, split:],
                             initial_state=state)
    assert _relative_error(torch.cat([first_out, second_out], dim=1), whole_out) < TOLERANCE
    assert _relative_error(state, whole_state) < TOLERANCE


def test_l2_norm_is_the_kimi_formula():
    x = torch.randn(5, 3, 16, dtype=torch.float64).float()
    assert torch.equal(l2_normalize(x), l2norm(x))


# --- gates and output norm -------------------------------------------------------------------------


def test_forget_gate_and_output_norm_match_transformers():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    config = KimiLinearConfig(hidden_size=24, linear_num_heads=2, linear_head_dim=8, vocab_size=32,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    gate = KimiLinearForgetGate(config)
    with torch.no_grad():
        for parameter in gate.parameters():
            parameter.normal_()
        gate.dt_bias.mul_(3)  # some softplus inputs past its linear threshold (20) and far below 0
    hidden = torch.randn(1, 5, 24) * 4
    f = gate.f_b_proj(gate.f_a_proj(hidden))[0]  # [5, H * K]
    ours = kimi_delta_gate(f, gate.A_log, gate.dt_bias, num_heads=2)
    expected = gate(hidden)[0]  # [5, H, K]
    assert ours.shape == (5, 2, 8) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)

    norm = KimiLinearRMSNormGated(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    ours_norm = SigmoidGatedRMSNorm(8, eps=1e-5)
    ours_norm.weight.data.copy_(norm.weight)
    x, z = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    torch.testing.assert_close(ours_norm(x, z), norm(x, z), rtol=1e-6, atol=1e-6)
    bf16 = ours_norm(x.bfloat16(), z.bfloat16())
    assert bf16.dtype == torch.bfloat16


# --- the backend -----------------------------------------------------------------------------------

# Request slot -> its whole sequence length; slots 1, 3 and 4 are never used.
SEQ_LENS = {2: 150, 0: 9, 5: 3, NUM_SLOTS: 5}
# Each step lists (slot, new tokens) in batch order; T == 1 entries are decodes; the padding slot
# plays a CUDA-graph padding request.
CHUNKED_STEPS = [
    [(2, 70), (0, 1), (5, 2), (NUM_SLOTS, 1)],
    [(NUM_SLOTS, 3), (2, 1), (0, 4)],
    [(0, 1), (5, 1), (2, 50), (NUM_SLOTS, 1)],
    [(2, 29), (0, 3)],
]
WHOLE_STEPS = [[(slot, seq_len) for slot, seq_len in SEQ_LENS.items()]]


def _sequences(dtype=torch.float32):
    """Per slot: its pre-conv inputs [L, 3HK], g [L, H, K] and beta [L, H]."""
    generator = torch.Generator().manual_seed(7)
    sequences = {}
    for slot, seq_len in SEQ_LENS.items():
        mixed_qkv = torch.randn(seq_len, LAYER.conv_dim, generator=generator).to(dtype)
        g = F.logsigmoid(torch.randn(seq_len, LAYER.num_heads, LAYER.head_dim, generator=generator) + 3)
        beta = torch.sigmoid(torch.randn(seq_len, LAYER.num_heads, generator=generator)).to(dtype)
        sequences[slot] = (mixed_qkv, g, beta)
    return sequences


def _reference(mixed_qkv, g, beta, conv_weight):
    """transformers over one whole sequence: output [L, H, K], conv state, recurrent state."""
    conv_out = causal_conv1d_fn(mixed_qkv[None].transpose(1, 2), conv_weight, None, activation="silu")
    seq_len = mixed_qkv.shape[0]
    q, k, v = (part.reshape(1, seq_len, LAYER.num_heads, LAYER.head_dim)
               for part in conv_out.transpose(1, 2)[0].split(LAYER.key_dim, dim=-1))
    out, recurrent_state = chunk_kimi_delta_attention(q, k, v, g=g[None], beta=beta[None], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    conv_state = F.pad(mixed_qkv.T, (LAYER.conv_kernel, 0))[:, -LAYER.conv_kernel:]
    return out[0], conv_state, recurrent_state[0]


def _run_steps(backend, steps, sequences, conv_weight, state, host_query_start_loc, num_padding_tokens=0):
    """Feed each request's tokens in order through the steps; returns each slot's outputs, joined."""
    consumed = {slot: 0 for slot in sequences}
    outputs = {slot: [] for slot in sequences}
    for step in steps:
        parts, query_lens = [], []
        for slot, num_new in step:
            start = consumed[slot]
            parts.append([tensor[start : start + num_new] for tensor in sequences[slot]])
            query_lens.append(num_new)
            consumed[slot] += num_new
        mixed_qkv, g, beta = (torch.cat([part[i] for part in parts]) for i in range(3))
        padded = [F.pad(x, (0, 0) * (x.dim() - 1) + (0, num_padding_tokens)) for x in (mixed_qkv, g, beta)]
        query_start_loc = F.pad(torch.tensor(query_lens).cumsum(0), (1, 0)).to(torch.int32)
        metadata = LinearAttentionMetadata(
            query_start_loc=query_start_loc, state_indices=torch.tensor([slot for slot, _ in step], dtype=torch.int32),
            num_reqs=len(step), num_tokens=sum(query_lens), max_query_len=max(query_lens),
            query_start_loc_cpu=query_start_loc.clone() if host_query_start_loc else None)
        out = backend.forward(LAYER, *padded, conv_weight, state, metadata)
        assert out.shape == (padded[0].shape[0], LAYER.num_heads, LAYER.head_dim)
        assert out.dtype == mixed_qkv.dtype
        assert torch.all(out[sum(query_lens):] == 0)  # padding token rows
        for (slot, _), start, end in zip(step, query_start_loc[:-1].tolist(), query_start_loc[1:].tolist()):
            outputs[slot].append(out[start:end])
    assert consumed == SEQ_LENS
    return {slot: torch.cat(chunks) for slot, chunks in outputs.items()}


def _fresh_state(backend, generator):
    """Random garbage everywhere, then the slots in use zeroed as the runner does at admission."""
    state = backend.allocate_state(NUM_SLOTS, LAYER)
    state.conv_state.copy_(torch.randn(state.conv_state.shape, generator=generator))
    state.recurrent_state.copy_(torch.randn(state.recurrent_state.shape, generator=generator))
    state.zero_slots(torch.tensor(list(SEQ_LENS), dtype=torch.long))
    return state


@pytest.mark.parametrize("host_query_start_loc", [True, False])
@pytest.mark.parametrize("steps", [CHUNKED_STEPS, WHOLE_STEPS], ids=["chunked", "whole"])
def test_backend_matches_transformers_per_request(steps, host_query_start_loc):
    generator = torch.Generator().manual_seed(11)
    backend = TorchKDABackend(torch.float32, torch.device("cpu"))
    conv_weight = torch.randn(LAYER.conv_dim, LAYER.conv_kernel, generator=generator) * 0.5
    state = _fresh_state(backend, generator)
    before = (state.conv_state.clone(), state.recurrent_state.clone())
    sequences = _sequences()

    outputs = _run_steps(backend, steps, sequences, conv_weight, state, host_query_start_loc, num_padding_tokens=2)

    for slot, (mixed_qkv, g, beta) in sequences.items():
        expected_out, expected_conv, expected_recurrent = _reference(mixed_qkv, g, beta, conv_weight)
        assert _relative_error(outputs[slot], expected_out) < TOLERANCE, f"slot {slot}"
        torch.testing.assert_close(state.conv_state[slot], expected_conv, rtol=0, atol=0)
        assert _relative_error(state.recurrent_state[slot], expected_recurrent) < TOLERANCE, f"slot {slot}"
    untouched = [slot for slot in range(NUM_SLOTS + 1) if slot not in SEQ_LENS]
    assert untouched == [1, 3, 4]
    assert torch.equal(state.conv_state[untouched], before[0][untouched])
    assert torch.equal(state.recurrent_state[untouched], before[1][untouched])


def test_state_layout_and_size():
    backend = TorchKDABackend(torch.bfloat16, torch.device("cpu"), state_dtype=torch.float32)
    state = backend.allocate_state(3, LAYER)
    assert state.conv_state.shape == (4, 3 * 2 * 16, 4) and state.conv_state.dtype == torch.bfloat16
    assert state.recurrent_state.shape == (4, 2, 16, 16) and state.recurrent_state.dtype == torch.float32
    assert backend.state_bytes_per_slot(LAYER) == 96 * 4 * 2 + 2 * 16 * 16 * 4
    # The 48B model's 20 KDA layers (32 heads of 128, 4-tap convs) in bf16 with fp32 states: ~42 MiB a request.
    real = KimiDeltaAttentionLayerSpec(layer_idx=0, num_heads=32, head_dim=128, conv_kernel=4)
    assert 20 * backend.state_bytes_per_slot(real) == 20 * (12288 * 4 * 2 + 32 * 128 * 128 * 4)
    assert 41 * 2**20 < 20 * backend.state_bytes_per_slot(real) < 42 * 2**20


def test_backend_bf16_keeps_dtypes_and_tracks_fp32():
    generator = torch.Generator().manual_seed(5)
    conv_weight = torch.randn(LAYER.conv_dim, LAYER.conv_kernel, generator=generator) * 0.5
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        backend = TorchKDABackend(dtype, torch.device("cpu"))
        state = backend.allocate_state(NUM_SLOTS, LAYER)
        results[dtype] = _run_steps(backend, CHUNKED_STEPS, _sequences(dtype), conv_weight.to(dtype), state, True)
        assert state.conv_state.dtype == dtype and state.recurrent_state.dtype == torch.float32
    for slot in SEQ_LENS:
        assert results[torch.bfloat16][slot].dtype == torch.bfloat16
        assert _relative_error(results[torch.bfloat16][slot], results[torch.float32][slot]) < 3e-2


def test_backend_rejects_mismatched_shapes():
    backend = TorchKDABackend(torch.float32, torch.device("cpu"))
    state = backend.allocate_state(NUM_SLOTS, LAYER)
    metadata = LinearAttentionMetadata(query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                                       state_indices=torch.tensor([0], dtype=torch.int32),
                                       num_reqs=1, num_tokens=3, max_query_len=3)
    qkv, g, beta = torch.zeros(3, LAYER.conv_dim), torch.zeros(3, 2, 16), torch.zeros(3, 2)
    weight = torch.zeros(LAYER.conv_dim, LAYER.conv_kernel)
    with pytest.raises(ValueError, match="mixed_qkv has shape"):
        backend.forward(LAYER, qkv[:, :-1], g, beta, weight, state, metadata)
    with pytest.raises(ValueError, match=r"g has shape \(3, 2\), expected \(3, 2, 16\) \(a decay per key channel\)"):
        backend.forward(LAYER, qkv, g[..., 0], beta, weight, state, metadata)
    with pytest.raises(ValueError, match="conv_weight has shape"):
        backend.forward(LAYER, qkv, g, beta, weight[:, :-1], state, metadata)
    with pytest.raises(ValueError, match="positive num_heads"):
        KimiDeltaAttentionLayerSpec(layer_idx=3, num_heads=0, head_dim=16, conv_kernel=4)


def test_backends_declare_themselves_and_are_chosen_by_platform(monkeypatch, caplog):
    from weir.plugin_manager import load_plugins
    from weir.plugins.attention.kda_fla import FlaKDABackend
    from weir.plugins.platforms.cuda import CudaPlatform

    assert TorchKDABackend.name == "kda_torch" and not TorchKDABackend.supports_cuda_graphs
    assert TorchKDABackend.supports("cpu", {"kimi_delta_attention"})
    assert TorchKDABackend.supports("cuda", {"kimi_delta_attention"})
    assert not TorchKDABackend.supports("cpu", {"gated_delta_net"})
    assert FlaKDABackend.supports("cuda", {"kimi_delta_attention"}) and not FlaKDABackend.supports(
        "cpu", {"kimi_delta_attention"})
    assert FlaKDABackend.supports_cuda_graphs

    registry = load_plugins({"builtin_platforms", "builtin_attention", "builtin_moe_backends"})
    kinds = {"mla", "kimi_delta_attention"}
    chosen = registry.select_attention_backends(registry.select_platform("cpu"), kinds)
    assert chosen["kimi_delta_attention"] is TorchKDABackend
    # Without fla, CUDA falls back to the torch backend and says why; named, it is refused.
    monkeypatch.setitem(sys.modules, "fla", None)
    assert "fla-core cannot be imported" in FlaKDABackend.unavailable_reason()
    chosen = registry.select_attention_backends(CudaPlatform(), kinds)
    assert chosen["kimi_delta_attention"] is TorchKDABackend
    assert "'kda_torch' is used instead of a preferred one" in caplog.text
    assert "'kda_fla' does not support this environment (fla-core cannot be imported" in caplog.text
    with pytest.raises(ValueError, match="kda_fla.*does not support this environment"):
        registry.select_attention_backends(CudaPlatform(), {"kimi_delta_attention"}, "kda_fla")


# --- weir.testing's check, for KDA backends ----------------------------------------------------------


def test_the_reference_passes_the_kda_check():
    check_linear_attention_backend(TorchKDABackend)
    check_linear_attention_backend(TorchKDABackend, dtype=torch.bfloat16, state_dtype=torch.bfloat16)


class _PerHeadDecay(TorchKDABackend):
    """Reads one decay per head (the first channel's), as a Gated DeltaNet kernel would."""

    name = "per_head_decay"

    def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata):
        return super().forward(layer, mixed_qkv, g[..., :1].expand_as(g), beta, conv_weight, state, metadata)


class _IgnoresConvWindow(TorchKDABackend):
    """Starts every request's conv from zeros, as a kernel that never reads the slot's window would."""

    name = "ignores_conv_window"

    def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata):
        state.conv_state.index_fill_(0, metadata.state_indices.long(), 0)
        return super().forward(layer, mixed_qkv, g, beta, conv_weight, state, metadata)


@pytest.mark.parametrize("backend_cls, message", [
    (_PerHeadDecay, r"'per_head_decay', layer .*, step 0 \(150, 1, 9\): output"),
    (_IgnoresConvWindow, r"'ignores_conv_window', layer .*, step 0 \(150, 1, 9\): output"),
])
def test_a_wrong_kda_backend_fails_naming_the_step(backend_cls, message):
    with pytest.raises(AssertionError, match=message):
        check_linear_attention_backend(backend_cls)


def test_the_check_refuses_kinds_it_does_not_know():
    class ToyBackend(TorchKDABackend):
        name = "toy"
        supported_layer_kinds = frozenset({"toy_sum"})

    with pytest.raises(ValueError, match=r"'toy' serves layer kinds \['toy_sum'\]; this check knows"):
        check_linear_attention_backend(ToyBackend)
