"""weir.testing: the conformance checks third-party backends run against the torch references,
each shown failing a wrong backend (``test_example_backends`` shows them passing real ones)."""

from __future__ import annotations

import pytest
import torch

from weir.plugins.attention.gdn_torch import TorchGDNBackend
from weir.plugins.moe_backends.torch_ref import TorchMoEBackend
from weir.testing import check_linear_attention_backend, check_moe_backend


class _DropsSharedExperts(TorchMoEBackend):
    name = "drops_shared"

    def route(self, router_logits, top_k, renormalize, num_shared_experts=0, shared_gate_logits=None):
        weights, ids = super().route(router_logits, top_k, renormalize, num_shared_experts, shared_gate_logits)
        weights[:, top_k:] = 0
        return weights, ids


class _PackedRouterRows(TorchMoEBackend):
    """Reads the router logits as if their rows were packed (a kernel ignoring their stride)."""

    name = "packed_rows"

    def route(self, router_logits, *args, **kwargs):
        packed = torch.as_strided(router_logits, router_logits.shape, (router_logits.shape[1], 1),
                                  router_logits.storage_offset())
        return super().route(packed, *args, **kwargs)


class _OneColumnShort(TorchMoEBackend):
    name = "short"

    def experts(self, *args, **kwargs):
        return super().experts(*args, **kwargs)[:, :-1]


@pytest.mark.parametrize("backend, message", [
    (_DropsSharedExperts(), r"'drops_shared', case .* = \(7, 8, 2, False, 1, 'silu'\): Tensor-likes are not close"),
    (_PackedRouterRows(), r"'packed_rows', case .* = \(7, 8, 2, False, 1, 'silu'\)"),
    (_OneColumnShort(), r"'short', case .*: got torch.float32 \(1, 31\), expected torch.float32 \(1, 32\)"),
])
def test_a_wrong_moe_backend_fails_naming_the_case(backend, message):
    with pytest.raises(AssertionError, match=message):
        check_moe_backend(backend)


class _RowStrideBlind(TorchGDNBackend):
    """Reads ``mixed_qkv`` as if its rows were packed, as a kernel indexing ``row * conv_dim`` would."""

    name = "stride_blind"

    def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata):
        packed = torch.as_strided(mixed_qkv, mixed_qkv.shape, (mixed_qkv.shape[1], 1), mixed_qkv.storage_offset())
        return super().forward(layer, packed, g, beta, conv_weight, state, metadata)


class _ForgetsState(TorchGDNBackend):
    """Reads the slots but never writes the recurrent state back."""

    name = "forgets_state"

    def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata):
        saved = state.recurrent_state.clone()
        out = super().forward(layer, mixed_qkv, g, beta, conv_weight, state, metadata)
        state.recurrent_state.copy_(saved)
        return out


class _ZeroesEveryStep(TorchGDNBackend):
    """Clears every slot but the padding one after each step, used or not."""

    name = "zeroes"

    def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata):
        out = super().forward(layer, mixed_qkv, g, beta, conv_weight, state, metadata)
        used = set(metadata.state_indices.tolist())
        for slot in range(state.conv_state.shape[0] - 1):
            if slot not in used:
                state.conv_state[slot] = 0
        return out


@pytest.mark.parametrize("backend_cls, message", [
    (_RowStrideBlind, r"'stride_blind', layer .*, step 0 \(150, 1, 9\): output"),
    (_ForgetsState, r"'forgets_state', layer .*, step 0 \(150, 1, 9\): recurrent state of the used slots"),
    (_ZeroesEveryStep, r"'zeroes' changed the conv_state of slots \[1, 3, 4\]"),
])
def test_a_wrong_linear_attention_backend_fails_naming_the_step(backend_cls, message):
    with pytest.raises(AssertionError, match=message):
        check_linear_attention_backend(backend_cls)


# ---------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_the_cuda_backends_conform():
    pytest.importorskip("fla")
    from weir.plugins.attention.gdn_fla import FlaGDNBackend
    from weir.plugins.moe_backends.triton_fused import TritonMoEBackend

    check_moe_backend(TritonMoEBackend(), device="cuda", dtype=torch.bfloat16)
    for state_dtype in (torch.float32, torch.bfloat16):
        check_linear_attention_backend(FlaGDNBackend, device="cuda", dtype=torch.bfloat16, state_dtype=state_dtype)


@pytest.mark.integration
def test_check_model_passes_the_example_model_plugin_and_the_hybrid_family(tmp_path):
    from helpers_models import make_tiny_qwen2, make_tiny_qwen3_next
    from weir.testing import check_model

    check_model(make_tiny_qwen2(tmp_path / "qwen2"), max_num_batched_tokens=16)  # examples/weir-plugin-qwen2
    check_model(make_tiny_qwen3_next(tmp_path / "qwen3-next"), num_tokens=8, max_num_batched_tokens=16)


@pytest.mark.integration
def test_check_model_names_the_step_where_a_wrong_model_diverges(tmp_path, monkeypatch):
    """A model whose norms come out 5% too large is caught at its first token."""
    from helpers_models import make_tiny_qwen3
    from weir.layers import RMSNorm
    from weir.testing import check_model

    forward = RMSNorm.forward

    def off_by_a_little(self, x, residual=None):
        result = forward(self, x, residual)
        if residual is None:
            return result * 1.05
        return result[0] * 1.05, result[1]

    monkeypatch.setattr(RMSNorm, "forward", off_by_a_little)
    with pytest.raises(AssertionError, match=r"prompt 0 \(3 tokens\): (greedy tokens differ from transformers' at "
                                             r"step 0|the logprob of token \d+ at step 0 differs)"):
        check_model(make_tiny_qwen3(tmp_path / "qwen3"), num_tokens=4)
