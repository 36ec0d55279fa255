"""The reference MoE backend against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weir.moe import MoEBackend, softmax_top_k
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
    output = backend.forward(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation)
    act = {"silu": F.silu, "gelu": F.gelu}[activation]
    expected = naive_moe(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, act)
    assert output.shape == hidden.shape and output.dtype == hidden.dtype
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_gate_rows_come_first():
    # Swapping the gate and up halves must change the result (silu is not symmetric).
    hidden, router_logits, w_gate_up, w_down = _random_moe(5, 8, 4, 3)
    swapped = torch.cat([w_gate_up[:, 4:], w_gate_up[:, :4]], dim=1)
    backend = TorchMoEBackend()
    output = backend.forward(hidden, router_logits, w_gate_up, w_down, 2, True)
    output_swapped = backend.forward(hidden, router_logits, swapped, w_down, 2, True)
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
    with pytest.raises(ValueError, match="top_k"):
        backend.forward(hidden, router_logits, w_gate_up, w_down, 4, True)
    with pytest.raises(ValueError, match="unknown MoE activation 'relu9'"):
        backend.forward(hidden, router_logits, w_gate_up, w_down, 2, True, activation="relu9")


def test_backend_contract():
    assert issubclass(TorchMoEBackend, MoEBackend)
    assert TorchMoEBackend.supports("cpu") and not TorchMoEBackend.supports("tpu")


def test_shared_gate_logits_without_shared_experts_are_an_error():
    # Gate logits with no shared expert to weight would be dropped without a word.
    hidden, router_logits, w_gate_up, w_down = _random_moe(5, 8, 4, 3)
    gate_logits = torch.zeros(5, 1)
    with pytest.raises(ValueError, match="num_shared_experts is 0"):
        TorchMoEBackend().forward(hidden, router_logits, w_gate_up, w_down, 2, True, "silu", 0, gate_logits)
    with pytest.raises(ValueError, match=r"shared_gate_logits must be \[5, 0\]"):
        TorchMoEBackend().route(router_logits, 2, True, 0, gate_logits)


def test_backend_overriding_forward_with_the_older_signature_still_runs_unshared_layers():
    """Shared-expert arguments reach a backend's forward only for layers that have shared experts."""
    from types import SimpleNamespace

    from weir.layers.moe import FusedExperts

    class OlderSignature(TorchMoEBackend):
        def forward(self, hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation="silu"):
            return super().forward(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, activation)

    experts = FusedExperts(4, 8, 6)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    hidden, router_logits = torch.randn(3, 8), torch.randn(3, 4)
    output = experts(hidden, router_logits, 2, True, SimpleNamespace(moe_backend=OlderSignature()))
    expected = TorchMoEBackend().forward(hidden, router_logits, experts.gate_up_proj, experts.down_proj, 2, True)
    torch.testing.assert_close(output, expected)
    # A layer with a shared expert needs the newer arguments: the error names the backend and them.
    shared = FusedExperts(4, 8, 6, num_shared_experts=1)
    with pytest.raises(TypeError, match="MoE backend 'torch' overrides forward without the num_shared_experts"):
        shared(hidden, router_logits, 2, True, SimpleNamespace(moe_backend=OlderSignature()),
               shared_gate_logits=torch.zeros(3, 1))


def test_a_backend_output_of_the_wrong_shape_is_named():
    from types import SimpleNamespace

    from weir.layers.moe import FusedExperts

    class Transposed(TorchMoEBackend):
        name = "transposed"

        def experts(self, *args, **kwargs):
            return super().experts(*args, **kwargs).t()

    experts = FusedExperts(4, 8, 6)
    with pytest.raises(RuntimeError, match=r"MoE backend 'transposed' returned torch.float32 \(8, 3\); expected "
                                           r"torch.float32 \(3, 8\)"):
        experts(torch.randn(3, 8), torch.randn(3, 4), 2, True, SimpleNamespace(moe_backend=Transposed()))
