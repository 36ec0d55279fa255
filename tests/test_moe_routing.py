"""weir.moe.Routing: every method against transformers' own MoE blocks (tiny, random, fp32 on the
CPU), hand-worked routings, the bad configs it refuses, and that its torch ops never read the
device (they run on meta tensors)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from weir.layers.moe import FusedExperts
from weir.moe import (SIGMOID_GROUPED_TOP_K, SOFTMAX_TOP_K, TOP_K_SOFTMAX, Routing, route_reference,
                      sigmoid_grouped_top_k)
from weir.plugins.moe_backends.torch_ref import TorchMoEBackend

HIDDEN, INTERMEDIATE, NUM_TOKENS = 16, 12, 37


@pytest.fixture(scope="module")
def transformers_models():
    import transformers

    return transformers


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer random: transformers initialises routers and biases to zeros and
    leaves expert weights uninitialised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)


def _weir_experts(hf_experts: torch.nn.Module, routing: Routing, shared_mlp: torch.nn.Module | None = None,
                  activation: str = "silu") -> FusedExperts:
    """A FusedExperts holding transformers' fused expert weights (and a shared MLP as one more expert)."""
    num_experts, two_intermediate, hidden = hf_experts.gate_up_proj.shape
    experts = FusedExperts(num_experts, hidden, two_intermediate // 2, activation,
                           num_shared_experts=int(shared_mlp is not None), routing=routing)
    with torch.no_grad():
        experts.gate_up_proj[:num_experts].copy_(hf_experts.gate_up_proj)
        experts.down_proj[:num_experts].copy_(hf_experts.down_proj)
        if shared_mlp is not None:
            gate_up = torch.cat([shared_mlp.gate_proj.weight, shared_mlp.up_proj.weight])
            experts.load_shared_expert(0, gate_up, shared_mlp.down_proj.weight)
    return experts


def _hidden(seed: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _compare(hf_block: torch.nn.Module, experts: FusedExperts, router_weight: torch.Tensor, seed: int,
             correction_bias: torch.Tensor | None = None) -> None:
    hidden = _hidden(seed)
    with torch.no_grad():
        expected = hf_block(hidden[None])[0]  # [T, H]
        logits = hidden @ router_weight.T  # [T, E], fp32 as transformers' routers compute it
        actual = experts(hidden, logits, SimpleNamespace(moe_backend=TorchMoEBackend()),
                         correction_bias=correction_bias)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_top_k_matches_qwen3_moe(transformers_models, norm_topk_prob):
    config = transformers_models.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                                num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    block = transformers_models.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    _randomise(block, seed=1)
    routing = Routing.softmax_top_k(config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
    _compare(block, _weir_experts(block.experts, routing), block.gate.weight, seed=2)


def test_top_k_softmax_matches_granitemoe_swa(transformers_models):
    config = transformers_models.GraniteMoeSWAConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                     num_local_experts=8, num_experts_per_tok=2)
    block = transformers_models.models.granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAMoE(config).eval()
    _randomise(block, seed=3)
    routing = Routing.top_k_softmax(config.num_local_experts, config.num_experts_per_tok)
    _compare(block, _weir_experts(block.experts, routing), block.router.weight, seed=4)


def test_top_k_softmax_matches_mixtral(transformers_models):
    """Mixtral takes the softmax over all experts and renormalises its top k: the same weights."""
    config = transformers_models.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                               num_local_experts=6, num_experts_per_tok=2)
    block = transformers_models.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).eval()
    _randomise(block, seed=5)
    routing = Routing.top_k_softmax(config.num_local_experts, config.num_experts_per_tok)
    _compare(block, _weir_experts(block.experts, routing), block.gate.weight, seed=6)


def _sigmoid_routing_of(config) -> Routing:
    return Routing.sigmoid_grouped_top_k(config.num_local_experts, config.num_experts_per_tok, config.n_group,
                                         config.topk_group, config.norm_topk_prob, config.routed_scaling_factor)


@pytest.mark.parametrize("n_group, topk_group, top_k, norm_topk_prob", [
    (4, 2, 4, True),  # group-limited: two of four groups kept
    (8, 3, 5, False),  # groups of two experts, unnormalised
    (1, 1, 6, True),  # no groups (Kimi's n_group = topk_group = 1)
])
def test_sigmoid_grouped_top_k_matches_deepseek_v3(transformers_models, n_group, topk_group, top_k, norm_topk_prob):
    config = transformers_models.DeepseekV3Config(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, n_routed_experts=16, num_experts_per_tok=top_k,
        n_shared_experts=1, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5)
    block = transformers_models.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config).eval()
    _randomise(block, seed=7)
    routing = _sigmoid_routing_of(config)
    experts = _weir_experts(block.experts, routing, shared_mlp=block.shared_experts)
    _compare(block, experts, block.gate.weight, seed=8, correction_bias=block.gate.e_score_correction_bias)


def test_sigmoid_grouped_top_k_matches_kimi_linear(transformers_models):
    config = transformers_models.KimiLinearConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=12, num_experts_per_token=3,
        num_shared_experts=1, num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446)
    block = transformers_models.models.kimi_linear.modeling_kimi_linear.KimiLinearMoE(config).eval()
    _randomise(block, seed=9)
    routing = _sigmoid_routing_of(config)
    assert (routing.num_experts, routing.top_k, routing.num_groups) == (12, 3, 1)
    experts = _weir_experts(block.experts, routing, shared_mlp=block.shared_experts)
    _compare(block, experts, block.gate.weight, seed=10, correction_bias=block.gate.e_score_correction_bias)


def test_the_correction_bias_chooses_and_the_scores_weigh():
    """4 experts in 2 groups, one kept, top 2. Expert 0 has the best score, but the bias makes
    group {2, 3} the better one; the weights are the chosen experts' unbiased sigmoids, scaled."""
    routing = Routing.sigmoid_grouped_top_k(4, 2, num_groups=2, top_k_groups=1, renormalize=False,
                                            routed_scaling_factor=2.0)
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.3, 0.3])
    weights, ids = route_reference(logits, routing, bias)
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(weights, 2.0 * torch.sigmoid(torch.tensor([[0.5, 0.0]])))
    # Without the bias, group {0, 1} wins (sigmoid(2) + sigmoid(-1) > sigmoid(0.5) + sigmoid(0)).
    weights, ids = route_reference(logits, routing, torch.zeros(4))
    assert ids.tolist() == [[0, 1]]
    renormalised = dataclasses.replace(routing, renormalize=True)
    weights, _ = route_reference(logits, renormalised, torch.zeros(4))
    scores = torch.sigmoid(torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(weights[0], 2.0 * scores / scores.sum())


def test_a_group_scores_its_two_best_experts():
    """Group {0, 1} holds the single best expert, group {2, 3} the best pair: the pair's group wins."""
    routing = Routing.sigmoid_grouped_top_k(4, 1, num_groups=2, top_k_groups=1, renormalize=True,
                                            routed_scaling_factor=1.0)
    _, ids = route_reference(torch.tensor([[3.0, -3.0, 1.0, 1.0]]), routing, torch.zeros(4))
    assert ids.tolist() == [[2]]  # the tie of experts 2 and 3 may go either way; 2 is what torch.topk keeps


def test_top_k_softmax_weighs_the_chosen_logits_alone():
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0]])
    weights, ids = route_reference(logits, Routing.top_k_softmax(4, 2))
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), dim=-1))
    softmax_weights, _ = route_reference(logits, Routing.softmax_top_k(4, 2, renormalize=False))
    assert softmax_weights.sum() < 0.99 and torch.allclose(weights.sum(), torch.tensor(1.0))


def test_logits_of_any_float_dtype_route_in_fp32():
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    for routing in (Routing.softmax_top_k(16, 3, True), Routing.top_k_softmax(16, 3),
                    Routing.sigmoid_grouped_top_k(16, 3, 4, 2, True, 2.5)):
        bias = torch.zeros(16, dtype=torch.bfloat16) if routing.uses_correction_bias else None
        weights, ids = route_reference(logits, routing, bias)
        float_bias = None if bias is None else bias.float()
        expected_weights, expected_ids = route_reference(logits.float(), routing, float_bias)
        assert weights.dtype == torch.float32 and torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)


def test_sigmoid_grouped_top_k_never_reads_the_device():
    """On meta tensors any host read (``item``, ``tolist``, data-dependent shapes) fails: the
    routing is CUDA-graph capturable and free of syncs."""
    routing = Routing.sigmoid_grouped_top_k(16, 4, num_groups=4, top_k_groups=2, renormalize=True,
                                            routed_scaling_factor=2.5)
    logits, bias = torch.empty(9, 16, device="meta"), torch.empty(16, device="meta")
    weights, ids = sigmoid_grouped_top_k(logits, bias, routing)
    assert weights.shape == ids.shape == (9, 4) and weights.dtype == torch.float32
    # The whole backend route, shared-expert slots included, too.
    weights, ids = TorchMoEBackend().route(logits, routing, bias, 1, None)
    assert weights.shape == (9, 5) and ids.device.type == "meta"
    with pytest.raises(Exception):  # and meta tensors do catch a host read
        logits.sum().item()


@pytest.mark.parametrize("make, message", [
    (lambda: Routing.softmax_top_k(8, 9, True), r"top_k must be in \[1, 8\] \(the number of experts\), got 9"),
    (lambda: Routing.top_k_softmax(8, 0), r"top_k must be in \[1, 8\]"),
    (lambda: Routing.sigmoid_grouped_top_k(8, 9, 1, 1, True, 1.0), r"top_k must be in \[1, 8\]"),
    (lambda: Routing.sigmoid_grouped_top_k(10, 2, 4, 2, True, 2.5),
     r"num_groups \(n_group\) must divide the 10 experts into equal groups, got 4"),
    (lambda: Routing.sigmoid_grouped_top_k(16, 2, 0, 1, True, 2.5), "must divide the 16 experts"),
    (lambda: Routing.sigmoid_grouped_top_k(16, 2, 4, 5, True, 2.5),
     r"top_k_groups \(topk_group\) must be in \[1, 4\] \(num_groups\), got 5"),
    (lambda: Routing.sigmoid_grouped_top_k(16, 2, 4, 0, True, 2.5), r"top_k_groups \(topk_group\) must be in"),
    (lambda: Routing.sigmoid_grouped_top_k(16, 9, 4, 2, True, 2.5),
     r"top_k=9 exceeds the 8 experts of the 2 kept groups \(4 experts each\)"),
    (lambda: Routing.sigmoid_grouped_top_k(4, 1, 4, 2, True, 2.5), "sums its two best experts, but 4 groups"),
    (lambda: Routing.sigmoid_grouped_top_k(8, 2, 2, 1, True, 0.0), "routed_scaling_factor must be a positive finite"),
    (lambda: Routing.sigmoid_grouped_top_k(8, 2, 2, 1, True, float("nan")), "positive finite"),
    (lambda: Routing(TOP_K_SOFTMAX, 8, 2, renormalize=True), "top_k_softmax weights already sum to 1"),
    (lambda: Routing(SOFTMAX_TOP_K, 8, 2, True, num_groups=2), "softmax_top_k routing has no expert groups"),
    (lambda: Routing(SOFTMAX_TOP_K, 8, 2, True, routed_scaling_factor=2.5), "no expert groups or scaling factor"),
    (lambda: Routing("sparsemixer", 8, 2), "unknown routing method 'sparsemixer'; known: softmax_top_k"),
    (lambda: Routing(SOFTMAX_TOP_K, 8, 2.0, True), "routing top_k must be an int, got 2.0"),
    (lambda: Routing(SOFTMAX_TOP_K, 8, 2, renormalize=1), "routing renormalize must be a bool"),
    (lambda: Routing(SOFTMAX_TOP_K, 0, 1), "at least one expert"),
])
def test_bad_configs_fail_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_routing_is_frozen():
    routing = Routing.softmax_top_k(8, 2, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        routing.top_k = 3
    assert routing == Routing(SOFTMAX_TOP_K, 8, 2, True) and hash(routing) == hash(Routing(SOFTMAX_TOP_K, 8, 2, True))


def test_bad_router_inputs_are_named():
    sigmoid = Routing.sigmoid_grouped_top_k(8, 2, 2, 1, True, 2.5)
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"sigmoid_grouped_top_k routing needs the layer's correction_bias \[8\]"):
        route_reference(logits, sigmoid)
    with pytest.raises(ValueError, match=r"correction_bias must be float \[8\], got torch.float32 \(7,\)"):
        route_reference(logits, sigmoid, torch.zeros(7))
    with pytest.raises(ValueError, match=r"correction_bias must be float \[8\], got torch.int64"):
        route_reference(logits, sigmoid, torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="softmax_top_k routing takes no correction_bias"):
        route_reference(logits, Routing.softmax_top_k(8, 2, True), torch.zeros(8))
    with pytest.raises(ValueError, match=r"router_logits must be \[num_tokens, 8\] \(the routed experts\), "
                                         r"got \(3, 6\)"):
        route_reference(logits[:, :6], sigmoid, torch.zeros(8))
    with pytest.raises(ValueError, match="router_logits must be floats"):
        route_reference(logits.long(), Routing.top_k_softmax(8, 2))
    assert SIGMOID_GROUPED_TOP_K == sigmoid.method and sigmoid.uses_correction_bias
