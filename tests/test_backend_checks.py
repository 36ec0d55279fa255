"""weir.testing: the conformance checks third-party backends run against the torch references,
each shown failing a wrong backend (``test_example_backends`` shows them passing real ones)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weir.moe import ROUTING_METHODS, SOFTMAX_TOP_K, Routing
from weir.plugins.attention.gdn_torch import TorchGDNBackend
from weir.plugins.moe_backends.torch_ref import TorchMoEBackend
from weir.testing import check_linear_attention_backend, check_moe_backend


class _DropsSharedExperts(TorchMoEBackend):
    name = "drops_shared"

    def route(self, router_logits, routing, correction_bias=None, num_shared_experts=0, shared_gate_logits=None):
        weights, ids = super().route(router_logits, routing, correction_bias, num_shared_experts, shared_gate_logits)
        weights[:, routing.top_k:] = 0
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


class _SoftmaxForEveryMethod(TorchMoEBackend):
    """Knows one routing: softmax over every expert, then top-k (renormalised, which is also
    top_k_softmax's result, for the other methods)."""

    name = "softmax_only"

    def route(self, router_logits, routing, correction_bias=None, *args):
        renormalize = routing.renormalize or routing.method != SOFTMAX_TOP_K
        softmax = Routing.softmax_top_k(routing.num_experts, routing.top_k, renormalize)
        return super().route(router_logits, softmax, None, *args)


class _IgnoresCorrectionBias(TorchMoEBackend):
    name = "no_bias"

    def route(self, router_logits, routing, correction_bias=None, *args):
        return super().route(router_logits, routing, None if correction_bias is None else correction_bias * 0, *args)


class _IgnoresExpertGroups(TorchMoEBackend):
    name = "no_groups"

    def route(self, router_logits, routing, *args):
        if routing.uses_correction_bias:
            routing = dataclasses.replace(routing, num_groups=1, top_k_groups=1)
        return super().route(router_logits, routing, *args)


class _ScalesSharedExperts(TorchMoEBackend):
    """Multiplies every slot by the routed scaling factor, the shared experts' too."""

    name = "scales_shared"

    def route(self, router_logits, routing, *args):
        weights, ids = super().route(router_logits, routing, *args)
        weights[:, routing.top_k:] *= routing.routed_scaling_factor
        return weights, ids


@pytest.mark.parametrize("backend, message", [
    (_DropsSharedExperts(), r"'drops_shared', MoECase\(num_tokens=7, .*num_shared=1, shared_gated=True, "
                            r"activation='silu'\): Tensor-likes are not close"),
    (_PackedRouterRows(), r"'packed_rows', MoECase\(num_tokens=7, routing=Routing\(method='softmax_top_k'"),
    (_OneColumnShort(), r"'short', MoECase\(num_tokens=1, .*: got torch.float32 \(1, 31\), expected torch.float32 "
                        r"\(1, 32\)"),
    # Passes the softmax and top-k-softmax cases, fails the first sigmoid one.
    (_SoftmaxForEveryMethod(), r"'softmax_only', MoECase\(num_tokens=13, routing=Routing\(method='sigmoid_grouped"),
    (_IgnoresCorrectionBias(), r"'no_bias', MoECase\(num_tokens=13, routing=Routing\(method='sigmoid_grouped"),
    (_IgnoresExpertGroups(), r"'no_groups', MoECase\(num_tokens=13, routing=Routing\(method='sigmoid_grouped"),
    (_ScalesSharedExperts(), r"'scales_shared', MoECase\(num_tokens=13, routing=Routing\(method='sigmoid_grouped"),
])
def test_a_wrong_moe_backend_fails_naming_the_case(backend, message):
    with pytest.raises(AssertionError, match=message):
        check_moe_backend(backend)


def test_the_moe_check_covers_every_routing_method_with_and_without_shared_experts():
    from weir.testing import MOE_CASES

    for method in ROUTING_METHODS:
        cases = [case for case in MOE_CASES if case.routing.method == method]
        assert {case.num_shared > 0 for case in cases} == {False, True}, method
    assert any(case.shared_gated for case in MOE_CASES) and any(
        case.num_shared and not case.shared_gated for case in MOE_CASES)


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
