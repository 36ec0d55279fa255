"""The reference MoE backend against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weir.moe import MoEBackend, Routing, softmax_top_k
from weir.plugins.moe_backends.torch_ref import TorchMoEBackend


def naive_moe(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, act):
    """One token at a time, one expert at a time, straight from the definition."""
    intermediate_size = w_down.shape[-1]
    output = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        probs = torch.softmax(router_logits[token].float(), dim=-1)
        weights, experts = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for weight, expert in zip(weights.tolist(), experts.tolist()):
            gate = w_gate_up[expert, :intermediate_size] @ hidden[token]
            up = w_gate_up[expert, intermediate_size:] @ hidden[token]
            output[token] += weight * (w_down[expert] @ (act(gate) * up))
    return output


def _random_moe(num_tokens, hidden_size, intermediate_size, num_experts, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    router_logits = torch.randn(num_tokens, num_experts, generator=generator)
    w_gate_up = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=generator) * 0.2
    w_down = torch.randn(num_experts, hidden_size, intermediate_size, generator=generator) * 0.2
    return hidden, router_logits, w_gate_up, w_down


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "activation"),
    [(17, 8, 2, "silu"), (3, 16, 4, "silu"), (1, 4, 1, "silu"), (9, 6, 3, "gelu")],
)
def test_torch_moe_matches_naive_loop(num_tokens, num_experts, top_k, activation, renormalize):
    hidden, router_logits, w_gate_up, w_down = _random_moe(num_tokens, 32, 24, num_experts)
    backend = TorchMoEBackend()
    routing = Routing.softmax_top_k(num_experts, top_k, renormalize)
    output = backend.forward(hidden, router_logits, w_gate_up, w_down, routing, activation)
    act = {"silu": F.silu, "gelu": F.gelu}[activation]
    expected = naive_moe(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, act)
    assert output.shape == hidden.shape and output.dtype == hidden.dtype
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_gate_rows_come_first():
    # Swapping the gate and up halves must change the result (silu is not symmetric).
    hidden, router_logits, w_gate_up, w_down = _random_moe(5, 8, 4, 3)
    swapped = torch.cat([w_gate_up[:, 4:], w_gate_up[:, :4]], dim=1)
    backend, routing = TorchMoEBackend(), Routing.softmax_top_k(3, 2, True)
    output = backend.forward(hidden, router_logits, w_gate_up, w_down, routing)
    output_swapped = backend.forward(hidden, router_logits, swapped, w_down, routing)
    assert not torch.allclose(output, output_swapped, atol=1e-3)


def test_routing_renormalises_top_k():
    router_logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, expert_ids = softmax_top_k(router_logits, top_k=2, renormalize=True)
    assert expert_ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(1))
    raw_weights, _ = softmax_top_k(router_logits, top_k=2, renormalize=False)
    assert raw_weights.sum().item() < 0.95


def test_bad_arguments_are_errors():
    hidden, router_logits, w_gate_up, w_down = _random_moe(2, 8, 4, 3)
    backend = TorchMoEBackend()
    with pytest.raises(ValueError, match=r"router_logits must be \[num_tokens, 4\]"):
        backend.forward(hidden, router_logits, w_gate_up[:2].repeat(2, 1, 1), w_down[:2].repeat(2, 1, 1),
                        Routing.softmax_top_k(4, 2, True))
    with pytest.raises(ValueError, match="expert weights hold 3 experts, but the routing has 3 and 1 are shared"):
        backend.forward(hidden, router_logits, w_gate_up, w_down, Routing.softmax_top_k(3, 2, True),
                        num_shared_experts=1)
    with pytest.raises(ValueError, match="unknown activation 'relu9'"):
        backend.forward(hidden, router_logits, w_gate_up, w_down, Routing.softmax_top_k(3, 2, True), "relu9")
    with pytest.raises(ValueError, match="routing must be a weir.moe.Routing, got int"):
        backend.forward(hidden, router_logits, w_gate_up, w_down, 2)


def test_backend_contract():
    assert issubclass(TorchMoEBackend, MoEBackend)
    assert TorchMoEBackend.supports("cpu") and not TorchMoEBackend.supports("tpu")


def test_shared_gate_logits_without_shared_experts_are_an_error():
    # Gate logits with no shared expert to weight would be dropped without a word.
    hidden, router_logits, w_gate_up, w_down = _random_moe(5, 8, 4, 3)
    gate_logits, routing = torch.zeros(5, 1), Routing.softmax_top_k(3, 2, True)
    with pytest.raises(ValueError, match="num_shared_experts is 0"):
        TorchMoEBackend().forward(hidden, router_logits, w_gate_up, w_down, routing, "silu", None, 0, gate_logits)
    with pytest.raises(ValueError, match=r"shared_gate_logits must be \[5, 0\]"):
        TorchMoEBackend().route(router_logits, routing, None, 0, gate_logits)


def _ctx(backend):
    from types import SimpleNamespace

    return SimpleNamespace(moe_backend=backend)


def test_fused_experts_route_as_their_routing_says():
    """The layer's routing reaches the backend: the same weights under two routings differ,
    and each equals the backend called with that routing."""
    from weir.layers.moe import FusedExperts

    hidden, router_logits = torch.randn(6, 8), torch.randn(6, 4) * 3
    outputs = []
    for routing in (Routing.softmax_top_k(4, 2, False), Routing.top_k_softmax(4, 2)):
        experts = FusedExperts(4, 8, 6, routing=routing)
        torch.manual_seed(0)
        torch.nn.init.normal_(experts.gate_up_proj)
        torch.nn.init.normal_(experts.down_proj)
        output = experts(hidden, router_logits, _ctx(TorchMoEBackend()))
        expected = TorchMoEBackend().forward(hidden, router_logits, experts.gate_up_proj, experts.down_proj, routing)
        torch.testing.assert_close(output, expected)
        outputs.append(output)
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-3)  # unnormalised vs normalised weights


def test_fused_experts_refuse_a_routing_of_another_size_and_unknown_activations():
    from weir.layers.moe import FusedExperts

    with pytest.raises(ValueError, match="the routing chooses among 8 experts, but the layer has 4 routed experts"):
        FusedExperts(4, 8, 6, routing=Routing.softmax_top_k(8, 2, True))
    with pytest.raises(ValueError, match="unknown activation 'relu9'; known: gelu, gelu_pytorch_tanh, silu, swish"):
        FusedExperts(4, 8, 6, "relu9", routing=Routing.softmax_top_k(4, 2, True))
    with pytest.raises(ValueError, match="routing must be a weir.moe.Routing, got tuple"):
        FusedExperts(4, 8, 6, routing=(2, True))


def test_a_backend_overriding_forward_with_another_signature_is_named():
    from weir.layers.moe import FusedExperts

    class OlderSignature(TorchMoEBackend):
        name = "older"

        def forward(self, hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation="silu"):
            return super().forward(hidden, router_logits, w_gate_up, w_down, Routing.softmax_top_k(4, top_k,
                                                                                                    renormalize))

    experts = FusedExperts(4, 8, 6, routing=Routing.softmax_top_k(4, 2, True))
    with pytest.raises(TypeError, match=r"MoE backend 'older' overrides forward with another signature than "
                                        r"weir.moe.MoEBackend.forward\(hidden, router_logits, w_gate_up, w_down, "
                                        r"routing, .*unexpected keyword argument 'routing'"):
        experts(torch.randn(3, 8), torch.randn(3, 4), _ctx(OlderSignature()))


def test_a_backend_output_of_the_wrong_shape_is_named():
    from weir.layers.moe import FusedExperts

    class Transposed(TorchMoEBackend):
        name = "transposed"

        def experts(self, *args, **kwargs):
            return super().experts(*args, **kwargs).t()

    experts = FusedExperts(4, 8, 6, routing=Routing.softmax_top_k(4, 2, True))
    with pytest.raises(RuntimeError, match=r"MoE backend 'transposed' returned torch.float32 \(8, 3\); expected "
                                           r"torch.float32 \(3, 8\)"):
        experts(torch.randn(3, 8), torch.randn(3, 4), _ctx(Transposed()))


def test_one_activation_table_for_dense_and_expert_mlps():
    from weir.layers.mlp import GatedMLP
    from weir.moe import ACTIVATIONS

    for name, fn in ACTIVATIONS.items():
        assert GatedMLP(4, 6, name).act_fn is fn
    assert ACTIVATIONS["swish"] is F.silu
    x = torch.linspace(-4, 4, 33)
    torch.testing.assert_close(ACTIVATIONS["gelu_pytorch_tanh"](x), F.gelu(x, approximate="tanh"))
    assert not torch.allclose(ACTIVATIONS["gelu"](x), ACTIVATIONS["gelu_pytorch_tanh"](x), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="hidden_act='relu9' is not supported by GatedMLP"):
        GatedMLP(4, 6, "relu9")
