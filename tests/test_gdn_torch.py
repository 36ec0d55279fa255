"""The torch Gated DeltaNet backend and its ops against the transformers torch fallbacks (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from weir.linear_attention import GatedDeltaNetLayerSpec, LinearAttentionMetadata
from weir.plugins.attention.gdn_torch import TorchGDNBackend
from weir.plugins.attention.gdn_torch_ops import (
    causal_conv1d_with_state,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

LAYER = GatedDeltaNetLayerSpec(layer_idx=0, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                               conv_kernel=4)
NUM_SLOTS = 6  # slot 6 is the padding slot
TOLERANCE = 1e-5


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _hf_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' prefill conv (zero left padding) + SiLU; x [batch, seq_len, channels]."""
    return causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)


# --- short conv ------------------------------------------------------------------------------------


def test_conv_with_zero_state_matches_transformers():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 24, generator=generator)  # [batch, seq_len, channels]
    weight = torch.randn(24, 4, generator=generator)
    out, new_state = causal_conv1d_with_state(x, torch.zeros(2, 24, 4), weight)
    torch.testing.assert_close(out, _hf_conv(x, weight), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_state, x[:, -4:].transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("chunk_lens", [[5, 2, 1, 1, 3, 1], [1, 1], [2, 1, 7]])
def test_conv_in_chunks_carries_state(chunk_lens):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(chunk_lens), 24, generator=generator)
    weight = torch.randn(24, 4, generator=generator)
    state = torch.zeros(1, 24, 4)
    outputs, start = [], 0
    for chunk_len in chunk_lens:
        out, state = causal_conv1d_with_state(x[:, start : start + chunk_len], state, weight)
        outputs.append(out)
        start += chunk_len
    torch.testing.assert_close(torch.cat(outputs, dim=1), _hf_conv(x, weight), rtol=1e-6, atol=1e-6)
    # The last 4 inputs, with zeros in front when fewer than 4 were seen.
    expected_state = F.pad(x.transpose(1, 2), (4, 0))[..., -4:]
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0)


# --- gated delta rule ------------------------------------------------------------------------------


def _rule_inputs(seq_len: int, with_state: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    batch, hk, hv, dk, dv = 2, LAYER.num_k_heads, LAYER.num_v_heads, LAYER.head_k_dim, LAYER.head_v_dim
    q = torch.randn(batch, seq_len, hk, dk, generator=generator)
    k = torch.randn(batch, seq_len, hk, dk, generator=generator)
    v = torch.randn(batch, seq_len, hv, dv, generator=generator)
    g = F.logsigmoid(torch.randn(batch, seq_len, hv, generator=generator) + 2)  # log-decay <= 0
    beta = torch.sigmoid(torch.randn(batch, seq_len, hv, generator=generator))
    state = torch.randn(batch, hv, dk, dv, generator=generator) if with_state else None
    return q, k, v, g, beta, state


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("seq_len", [1, 7, 64, 100, 130])
def test_delta_rule_matches_transformers(seq_len, with_state):
    q, k, v, g, beta, state = _rule_inputs(seq_len, with_state)
    hf_kwargs = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected_chunk = torch_chunk_gated_delta_rule(q, k, v, **hf_kwargs)
    expected_recurrent = torch_recurrent_gated_delta_rule(q, k, v, **hf_kwargs)
    for ours, expected in [(chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state), expected_chunk),
                           (recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state), expected_recurrent)]:
        out, final_state = ours
        assert out.shape == (2, seq_len, LAYER.num_v_heads, LAYER.head_v_dim)
        assert final_state.dtype == torch.float32
        assert _relative_error(out, expected[0]) < TOLERANCE
        assert _relative_error(final_state, expected[1]) < TOLERANCE


def test_chunk_rule_continues_from_state():
    """Two chunked calls carrying the state equal one call, across the chunk-size boundary."""
    q, k, v, g, beta, _ = _rule_inputs(150, with_state=False, seed=3)
    whole_out, whole_state = chunk_gated_delta_rule(q, k, v, g, beta)
    first_out, state = chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70])
    second_out, state = chunk_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:],
                                               initial_state=state)
    assert _relative_error(torch.cat([first_out, second_out], dim=1), whole_out) < TOLERANCE
    assert _relative_error(state, whole_state) < TOLERANCE


# --- the backend -----------------------------------------------------------------------------------

# Request slot -> its whole sequence length; slots 1, 3 and 4 are never used.
SEQ_LENS = {2: 150, 0: 9, 5: 3, NUM_SLOTS: 5}
# Each step lists (slot, new tokens) in batch order; T == 1 entries are decodes.
CHUNKED_STEPS = [
    [(2, 70), (0, 1), (5, 2), (NUM_SLOTS, 1)],
    [(NUM_SLOTS, 3), (2, 1), (0, 4)],
    [(0, 1), (5, 1), (2, 50), (NUM_SLOTS, 1)],
    [(2, 29), (0, 3)],
]
WHOLE_STEPS = [[(slot, seq_len) for slot, seq_len in SEQ_LENS.items()]]


def _sequences(dtype=torch.float32):
    """Per slot: its pre-conv inputs [L, conv_dim], g and beta [L, num_v_heads]."""
    generator = torch.Generator().manual_seed(7)
    sequences = {}
    for slot, seq_len in SEQ_LENS.items():
        mixed_qkv = torch.randn(seq_len, LAYER.conv_dim, generator=generator).to(dtype)
        g = F.logsigmoid(torch.randn(seq_len, LAYER.num_v_heads, generator=generator) + 2)
        beta = torch.sigmoid(torch.randn(seq_len, LAYER.num_v_heads, generator=generator)).to(dtype)
        sequences[slot] = (mixed_qkv, g, beta)
    return sequences


def _reference(mixed_qkv, g, beta, conv_weight):
    """transformers over one whole sequence: output [L, HV, Dv], conv state, recurrent state."""
    conv_out = _hf_conv(mixed_qkv[None], conv_weight)[0]  # [L, conv_dim]
    q, k, v = conv_out.split([LAYER.key_dim, LAYER.key_dim, LAYER.value_dim], dim=-1)
    seq_len = mixed_qkv.shape[0]
    out, recurrent_state = torch_chunk_gated_delta_rule(
        q.reshape(1, seq_len, LAYER.num_k_heads, LAYER.head_k_dim),
        k.reshape(1, seq_len, LAYER.num_k_heads, LAYER.head_k_dim),
        v.reshape(1, seq_len, LAYER.num_v_heads, LAYER.head_v_dim),
        g=g[None], beta=beta[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
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
        mixed_qkv = F.pad(mixed_qkv, (0, 0, 0, num_padding_tokens))
        query_start_loc = F.pad(torch.tensor(query_lens).cumsum(0), (1, 0)).to(torch.int32)
        metadata = LinearAttentionMetadata(
            query_start_loc=query_start_loc, state_indices=torch.tensor([slot for slot, _ in step], dtype=torch.int32),
            num_reqs=len(step), num_tokens=sum(query_lens), max_query_len=max(query_lens),
            query_start_loc_cpu=query_start_loc.clone() if host_query_start_loc else None)
        out = backend.forward(LAYER, mixed_qkv, F.pad(g, (0, 0, 0, num_padding_tokens)),
                              F.pad(beta, (0, 0, 0, num_padding_tokens)), conv_weight, state, metadata)
        assert out.shape == (mixed_qkv.shape[0], LAYER.num_v_heads, LAYER.head_v_dim)
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
    backend = TorchGDNBackend(torch.float32, torch.device("cpu"))
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


def test_backend_bf16_keeps_dtypes_and_tracks_fp32():
    generator = torch.Generator().manual_seed(5)
    conv_weight = torch.randn(LAYER.conv_dim, LAYER.conv_kernel, generator=generator) * 0.5
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        backend = TorchGDNBackend(dtype, torch.device("cpu"))
        state = backend.allocate_state(NUM_SLOTS, LAYER)
        outputs = _run_steps(backend, CHUNKED_STEPS, _sequences(dtype), conv_weight.to(dtype), state, True)
        assert state.conv_state.dtype == dtype and state.recurrent_state.dtype == torch.float32
        results[dtype] = outputs
    for slot in SEQ_LENS:
        assert results[torch.bfloat16][slot].dtype == torch.bfloat16
        assert _relative_error(results[torch.bfloat16][slot], results[torch.float32][slot]) < 3e-2


def test_backend_rejects_mismatched_shapes():
    backend = TorchGDNBackend(torch.float32, torch.device("cpu"))
    state = backend.allocate_state(NUM_SLOTS, LAYER)
    metadata = LinearAttentionMetadata(query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                                       state_indices=torch.tensor([0], dtype=torch.int32),
                                       num_reqs=1, num_tokens=3, max_query_len=3)
    g = beta = torch.zeros(3, LAYER.num_v_heads)
    with pytest.raises(ValueError, match="mixed_qkv has shape"):
        backend.forward(LAYER, torch.zeros(3, LAYER.conv_dim - 1), g, beta,
                        torch.zeros(LAYER.conv_dim, LAYER.conv_kernel), state, metadata)
    with pytest.raises(ValueError, match="conv_weight has shape"):
        backend.forward(LAYER, torch.zeros(3, LAYER.conv_dim), g, beta,
                        torch.zeros(LAYER.conv_dim, LAYER.conv_kernel + 1), state, metadata)


def test_backend_declares_itself():
    assert TorchGDNBackend.name == "gdn_torch"
    assert TorchGDNBackend.supports("cpu", {"gated_delta_net"})
    assert TorchGDNBackend.supports("cuda", {"gated_delta_net"})
    assert not TorchGDNBackend.supports("cpu", {"attention"})
    assert not TorchGDNBackend.supports_cuda_graphs
