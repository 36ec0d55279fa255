"""The Triton fused MoE backend against TorchMoEBackend, its oracle.

Each ``check_*`` runs on the CPU in Triton's interpreter (a subprocess, see helpers_triton) and
compiled on CUDA (marked gpu), in fp32, where the two backends agree to rounding. The GPU tests
add bf16 at Qwen3-Next shapes (E=512, top_k=10, H=2048, I=512) and CUDA-graph replay.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from helpers_triton import kernel_check_tests
from weir.moe import Routing, route_reference, softmax_top_k
from weir.plugins.moe_backends.torch_ref import TorchMoEBackend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 64, 32
ROUTINGS = (  # one of each method over NUM_EXPERTS
    Routing.softmax_top_k(NUM_EXPERTS, TOP_K, renormalize=True),
    Routing.softmax_top_k(NUM_EXPERTS, TOP_K, renormalize=False),
    Routing.top_k_softmax(NUM_EXPERTS, TOP_K),
    Routing.sigmoid_grouped_top_k(NUM_EXPERTS, TOP_K, num_groups=4, top_k_groups=2, renormalize=True,
                                  routed_scaling_factor=2.5),
)


def _kernels():
    from weir.plugins.moe_backends import triton_fused_kernels  # imports triton: only inside a check

    return triton_fused_kernels


def _backend(tiles=None):
    from weir.plugins.moe_backends.triton_fused import TritonMoEBackend

    backend = TritonMoEBackend()
    backend.tiles = tiles
    return backend


def _moe_weights(num_experts, hidden, intermediate, device, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    w_down = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    return w_gate_up.to(device=device, dtype=dtype), w_down.to(device=device, dtype=dtype)


def _randn(*shape, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _assert_matches_reference(actual, expected):
    """fp32: the two backends differ only in summation order."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(expected.abs().amax().item(), 1e-6)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale)


def _skewed_ids(num_tokens, num_experts, top_k, hot_expert, seed):
    """Slot 0 of every token goes to ``hot_expert``; the other slots to distinct other experts."""
    rng = random.Random(seed)
    others = [expert for expert in range(num_experts) if expert != hot_expert]
    rows = [[hot_expert] + rng.sample(others, top_k - 1) for _ in range(num_tokens)]
    return torch.tensor(rows, dtype=torch.int64)


def _assert_valid_alignment(topk_ids, num_experts, block_m, sorted_ids, expert_ids, num_padded):
    num_assignments = topk_ids.numel()
    flat_ids = topk_ids.reshape(-1).tolist()
    counts = [flat_ids.count(expert) for expert in range(num_experts)]
    padded_counts = [math.ceil(count / block_m) * block_m for count in counts]
    total = num_padded.item()
    assert total == sum(padded_counts)
    assert sorted_ids.shape[0] >= total and expert_ids.shape[0] >= total // block_m
    listed = sorted_ids[:total].tolist()
    # Every assignment exactly once; the rest of the list is sentinel padding.
    assert sorted(entry for entry in listed if entry != num_assignments) == list(range(num_assignments))
    group_start = 0
    for expert in range(num_experts):
        group = listed[group_start:group_start + padded_counts[expert]]
        assert sorted(entry for entry in group if entry != num_assignments) == [
            assignment for assignment, owner in enumerate(flat_ids) if owner == expert]
        assert group.count(num_assignments) == padded_counts[expert] - counts[expert] < block_m
        blocks = expert_ids[group_start // block_m:(group_start + padded_counts[expert]) // block_m].tolist()
        assert blocks == [expert] * (padded_counts[expert] // block_m)
        group_start += padded_counts[expert]


def check_alignment(device):
    routings = {
        "random": softmax_top_k(_randn(33, NUM_EXPERTS, device="cpu", seed=1), TOP_K, True)[1],
        "one token (six experts empty)": torch.tensor([[6, 1]]),
        "every token on expert 5": _skewed_ids(40, NUM_EXPERTS, TOP_K, hot_expert=5, seed=2),
    }
    for name, topk_ids in routings.items():
        for block_m in (16, 32):
            aligned = _kernels().align_assignments(topk_ids.to(device), NUM_EXPERTS, block_m)
            try:
                _assert_valid_alignment(topk_ids, NUM_EXPERTS, block_m, *(t.cpu() for t in aligned))
            except AssertionError as error:
                raise AssertionError(f"{name}, block_m {block_m}") from error


def _bias_for(routing, device, seed):
    if not routing.uses_correction_bias:
        return None
    return _randn(routing.num_experts, device=device, seed=seed) * 0.5


def check_matches_torch(device):
    w_gate_up, w_down = _moe_weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device)
    for routing in ROUTINGS:
        bias = _bias_for(routing, device, seed=50)
        for num_tokens in (1, 5, 33):
            hidden = _randn(num_tokens, HIDDEN, device=device, seed=num_tokens)
            router_logits = _randn(num_tokens, NUM_EXPERTS, device=device, seed=100 + num_tokens)
            args = (hidden, router_logits, w_gate_up, w_down, routing)
            expected = TorchMoEBackend().forward(*args, correction_bias=bias)
            actual = _backend().forward(*args, correction_bias=bias)
            _assert_matches_reference(actual, expected)


def check_shared_experts_match_torch(device):
    # One gated shared expert after the routed ones (Qwen3-Next), then two ungated ones (DeepSeek
    # has one); the gate logits are a strided column of a wider router output, as the model
    # passes them. Every routing method fills the slots before the shared ones.
    for routing in ROUTINGS:
        bias = _bias_for(routing, device, seed=51)
        for num_shared, gated in ((1, True), (2, False)):
            w_gate_up, w_down = _moe_weights(NUM_EXPERTS + num_shared, HIDDEN, INTERMEDIATE, device, seed=20)
            for num_tokens in (1, 19):
                hidden = _randn(num_tokens, HIDDEN, device=device, seed=num_tokens)
                logits = _randn(num_tokens, NUM_EXPERTS + num_shared, device=device, seed=21)
                router_logits, gate_logits = logits[:, :NUM_EXPERTS], (logits[:, NUM_EXPERTS:] if gated else None)
                args = (hidden, router_logits, w_gate_up, w_down, routing, "silu", bias, num_shared, gate_logits)
                expected = TorchMoEBackend().forward(*args)
                _assert_matches_reference(_backend().forward(*args), expected)
                # The same as routed experts plus each shared expert's (gated) MLP, written out.
                routed = TorchMoEBackend().forward(hidden, router_logits, w_gate_up[:NUM_EXPERTS],
                                                   w_down[:NUM_EXPERTS], routing, correction_bias=bias)
                for index in range(num_shared):
                    expert = NUM_EXPERTS + index
                    gate, up = (hidden @ w_gate_up[expert].T).chunk(2, dim=-1)
                    mlp = (torch.nn.functional.silu(gate) * up) @ w_down[expert].T
                    scale = torch.sigmoid(gate_logits[:, index:index + 1]) if gated else 1.0
                    routed = routed + scale * mlp
                _assert_matches_reference(expected, routed)


def check_one_expert_takes_every_token(device):
    # 33 rows on one expert span three blocks of 16; most other experts get a row or two.
    w_gate_up, w_down = _moe_weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device, seed=3)
    hidden = _randn(33, HIDDEN, device=device, seed=4)
    topk_ids = _skewed_ids(33, NUM_EXPERTS, TOP_K, hot_expert=2, seed=5).to(device)
    topk_weights = torch.rand(33, TOP_K, generator=torch.Generator().manual_seed(6)).to(device)
    expected = TorchMoEBackend().experts(hidden, topk_weights, topk_ids, w_gate_up, w_down)
    _assert_matches_reference(_backend().experts(hidden, topk_weights, topk_ids, w_gate_up, w_down), expected)


def check_ragged_shapes_strides_and_tiles(device):
    # H=48, I=24 are not multiples of the 32-wide K tiles (masked K) nor of the 32-wide N tile of
    # the first GEMM; hidden rows and down weights are strided views; gelu; other block_m values.
    from weir.plugins.moe_backends.triton_fused_kernels import GemmTiles, MoETiles

    num_experts, top_k, hidden_size, intermediate = 6, 3, 48, 24
    w_gate_up, _ = _moe_weights(num_experts, hidden_size, intermediate, device, seed=7)
    w_down = (_randn(num_experts, intermediate, hidden_size, device=device, seed=8) * 0.2).transpose(1, 2)
    hidden = _randn(21, hidden_size + 5, device=device, seed=9)[:, 5:]
    router_logits = _randn(21, num_experts, device=device, seed=10)
    routing = Routing.softmax_top_k(num_experts, top_k, renormalize=False)
    expected = TorchMoEBackend().forward(hidden, router_logits, w_gate_up, w_down, routing, "gelu")
    for tiles in (MoETiles(16, GemmTiles(32, 32, 4, 2), GemmTiles(32, 32, 4, 2)),
                  MoETiles(32, GemmTiles(16, 16, 4, 2), GemmTiles(64, 16, 4, 2)),
                  MoETiles(64, GemmTiles(32, 64, 4, 2), GemmTiles(16, 32, 4, 2)),
                  MoETiles(128, GemmTiles(32, 32, 8, 2), GemmTiles(64, 32, 8, 2))):
        actual = _backend(tiles).forward(hidden, router_logits, w_gate_up, w_down, routing, "gelu")
        _assert_matches_reference(actual, expected)


def check_every_activation_matches_torch(device):
    # The activation table's names, aliases included, each reach the kernel's own version.
    from weir.moe import ACTIVATIONS

    w_gate_up, w_down = _moe_weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device, seed=30)
    hidden = _randn(9, HIDDEN, device=device, seed=31) * 2  # wide enough for the forms to differ
    router_logits = _randn(9, NUM_EXPERTS, device=device, seed=32)
    outputs = {}
    for activation in ACTIVATIONS:
        args = (hidden, router_logits, w_gate_up, w_down, ROUTINGS[0], activation)
        outputs[activation] = _backend().forward(*args)
        _assert_matches_reference(outputs[activation], TorchMoEBackend().forward(*args))
    assert not torch.allclose(outputs["gelu"], outputs["gelu_pytorch_tanh"], rtol=0, atol=1e-6)


def check_out_of_range_ids_contribute_nothing(device):
    w_gate_up, w_down = _moe_weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device, seed=11)
    hidden = _randn(4, HIDDEN, device=device, seed=12)
    topk_ids = torch.tensor([[0, 3], [-1, 2], [7, NUM_EXPERTS], [1, 5]], device=device)
    topk_weights = torch.full((4, TOP_K), 0.5, device=device)
    in_range = (topk_ids >= 0) & (topk_ids < NUM_EXPERTS)
    expected = TorchMoEBackend().experts(hidden, topk_weights * in_range, topk_ids.clamp(0, NUM_EXPERTS - 1),
                                         w_gate_up, w_down)
    _assert_matches_reference(_backend().experts(hidden, topk_weights, topk_ids, w_gate_up, w_down), expected)


def check_no_tokens(device):
    w_gate_up, w_down = _moe_weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device)
    hidden = torch.empty(0, HIDDEN, device=device)
    for routing in ROUTINGS:
        out = _backend().forward(hidden, torch.empty(0, NUM_EXPERTS, device=device), w_gate_up, w_down, routing,
                                 correction_bias=_bias_for(routing, device, seed=0))
        assert out.shape == (0, HIDDEN)


def _tie_free_logits(num_tokens, num_experts, device, dtype, scale, offset):
    """Router logits with no ties in any row: fp32 random normals times ``scale``; in 16 bits,
    distinct values they hold exactly (k / 32 - offset, k < 256)."""
    if dtype == torch.float32:
        return _randn(num_tokens, num_experts, device=device, seed=num_experts) * scale
    generator = torch.Generator().manual_seed(num_experts)
    ranks = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(num_tokens)])
    return (ranks.float() / 32 - offset).to(device, dtype)


def check_routing_kernel_matches_the_reference(device):
    from weir.moe import append_shared_experts
    from weir.plugins.moe_backends.triton_routing_kernels import top_k_route_triton

    for num_tokens, num_experts, top_k, renormalize, dtype in (
            (7, 6, 3, False, torch.float32), (5, 60, 4, True, torch.float32), (3, 512, 10, True, torch.float32),
            (4, 200, 10, True, torch.bfloat16), (2, 8, 8, True, torch.float32), (3, 5, 1, False, torch.float32)):
        logits = _tie_free_logits(num_tokens, num_experts, device, dtype, scale=3, offset=3)
        for routing in (Routing.softmax_top_k(num_experts, top_k, renormalize),
                        Routing.top_k_softmax(num_experts, top_k)):
            expected_weights, expected_ids = route_reference(logits, routing)
            weights, ids = top_k_route_triton(logits, routing)
            where = (routing, dtype)
            assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (num_tokens, top_k)
            assert torch.equal(ids.long().cpu(), expected_ids.cpu()), where
            torch.testing.assert_close(weights.cpu(), expected_weights.cpu(), rtol=1e-5, atol=1e-6, msg=str(where))
    for routing in (Routing.softmax_top_k(5, 3, True), Routing.top_k_softmax(5, 3)):
        # Ties go to the lower expert id; a strided view of the logits reads the right row elements.
        tied = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=device)
        weights, ids = top_k_route_triton(tied, routing)
        assert ids.tolist() == [[1, 2, 4]] and torch.allclose(weights.cpu(), torch.full((1, 3), 1 / 3))
    for routing in (Routing.softmax_top_k(10, 2, False), Routing.top_k_softmax(10, 2)):
        wide = _randn(3, 20, device=device, seed=1)
        _, ids = top_k_route_triton(wide[:, ::2], routing)
        assert torch.equal(ids.long().cpu(), route_reference(wide[:, ::2], routing)[1].cpu())
    # A NaN or inf logit makes garbage weights (as torch's would be) but never an id out of range.
    broken = torch.tensor([[float("nan"), 1.0, 2.0, 3.0], [float("inf"), 0.0, 1.0, 2.0],
                           [float("-inf"), float("-inf"), float("-inf"), float("nan")]], device=device)
    for routing in (Routing.softmax_top_k(4, 2, False), Routing.top_k_softmax(4, 3)):
        _, ids = top_k_route_triton(broken, routing)
        assert ((ids >= 0) & (ids < 4)).all(), routing
    # Shared experts take the slots after the top k, weighted sigmoid(gate logit) or 1.
    logits = _randn(6, 17, device=device, seed=5)
    for routing in (Routing.softmax_top_k(15, 4, True), Routing.top_k_softmax(15, 4)):
        for num_shared, gate_logits in ((1, logits[:, 16:]), (2, None), (2, logits[:, 15:])):
            expected_weights, expected_ids = append_shared_experts(
                *route_reference(logits[:, :15], routing), 15, num_shared, gate_logits)
            weights, ids = top_k_route_triton(logits[:, :15], routing, num_shared, gate_logits)
            assert ids.shape == (6, 4 + num_shared) and torch.equal(ids.long().cpu(), expected_ids.cpu())
            torch.testing.assert_close(weights.cpu(), expected_weights.cpu(), rtol=1e-5, atol=1e-6)


def check_grouped_routing_kernel_matches_the_reference(device):
    """``sigmoid_grouped_top_k`` in one kernel: DeepSeek-V3's groups (8 of 32, 4 kept), Kimi's
    single group, every group kept, group sizes and counts off powers of two, bf16 logits."""
    from weir.moe import append_shared_experts
    from weir.plugins.moe_backends.triton_routing_kernels import sigmoid_grouped_route_triton

    cases = (  # num_tokens, experts, top_k, groups, kept groups, renormalize, scaling, logits dtype
        (9, 256, 8, 8, 4, True, 2.5, torch.float32), (5, 256, 8, 1, 1, True, 2.446, torch.float32),
        (6, 64, 6, 8, 8, False, 1.0, torch.float32), (7, 18, 3, 3, 2, True, 1.5, torch.float32),
        (4, 8, 2, 4, 2, False, 0.5, torch.float32), (3, 40, 5, 5, 3, True, 1.0, torch.bfloat16),
        (5, 12, 4, 3, 1, True, 1.0, torch.float16),  # top_k = every expert of the one kept group
        (4, 6, 3, 6, 6, False, 1.0, torch.float32), (0, 256, 8, 8, 4, True, 2.5, torch.float32))
    for num_tokens, num_experts, top_k, num_groups, kept, renormalize, factor, dtype in cases:
        routing = Routing.sigmoid_grouped_top_k(num_experts, top_k, num_groups, kept, renormalize, factor)
        bias = _randn(num_experts, device=device, seed=num_experts + 1) * 0.5
        logits = _tie_free_logits(num_tokens, num_experts, device, dtype, scale=2, offset=0.6)
        for num_shared, gate_logits in ((0, None), (1, None), (2, _randn(num_tokens, 2, device=device, seed=3))):
            expected_weights, expected_ids = route_reference(logits, routing, bias)
            if num_shared:
                expected_weights, expected_ids = append_shared_experts(expected_weights, expected_ids, num_experts,
                                                                       num_shared, gate_logits)
            weights, ids = sigmoid_grouped_route_triton(logits, bias, routing, num_shared, gate_logits)
            where = (routing, dtype, num_shared)
            assert weights.dtype == torch.float32 and ids.dtype == torch.int32, where
            assert ids.shape == (num_tokens, top_k + num_shared), where
            assert torch.equal(ids.long().cpu(), expected_ids.cpu()), where
            torch.testing.assert_close(weights.cpu(), expected_weights.cpu(), rtol=1e-5, atol=1e-6, msg=str(where))
    # A group's score counts a tie at its top twice (torch.topk(2)): group 1's logits [3, 3, -9]
    # beat group 0's [5, -9, -9] only so, and it is kept alone; its tie goes to the lower id.
    routing = Routing.sigmoid_grouped_top_k(6, 1, 2, 1, False, 1.0)
    tied = torch.tensor([[5.0, -9.0, -9.0, 3.0, 3.0, -9.0]], device=device)
    _, ids = sigmoid_grouped_route_triton(tied, torch.zeros(6, device=device), routing)
    assert ids.tolist() == [[3]]
    # Rows of a wider router output (the kernel reads the row stride) and a strided view (made
    # contiguous first) read the right elements.
    routing = Routing.sigmoid_grouped_top_k(8, 3, 4, 2, True, 1.0)
    wide = _randn(3, 16, device=device, seed=2)
    bias = _randn(8, device=device, seed=4)
    for view in (wide[:, :8], wide[:, ::2]):
        weights, ids = sigmoid_grouped_route_triton(view, bias, routing)
        expected_weights, expected_ids = route_reference(view, routing, bias)
        assert torch.equal(ids.long().cpu(), expected_ids.cpu())
        torch.testing.assert_close(weights.cpu(), expected_weights.cpu(), rtol=1e-5, atol=1e-6)
    # NaN or infinite logits and bias make garbage weights, but the ids stay distinct and in
    # range, from kept groups only, whatever the scores hold.
    broken = torch.tensor([[float("nan")] * 8, [float("inf"), float("-inf")] * 4, [0.0] * 7 + [float("nan")],
                           [float("-inf")] * 8], device=device)
    for bias in (torch.zeros(8, device=device), torch.full((8,), float("nan"), device=device),
                 torch.full((8,), -3e38, device=device), torch.full((8,), float("-inf"), device=device)):
        _, ids = sigmoid_grouped_route_triton(broken, bias, routing)
        assert ((ids >= 0) & (ids < 8)).all(), ids
        for row in ids.tolist():
            assert len(set(row)) == 3 and len({expert // 2 for expert in row}) <= 2, (bias, ids)


def check_backend_routes_each_method(device):
    """The backend's route: one fused kernel per method, int32 ids, the reference's weights and ids."""
    logits = _randn(11, NUM_EXPERTS + 1, device=device, seed=40)
    for routing in ROUTINGS:
        bias = _bias_for(routing, device, seed=41)
        weights, ids = _backend().route(logits[:, :NUM_EXPERTS], routing, bias, 1, logits[:, NUM_EXPERTS:])
        expected_weights, expected_ids = TorchMoEBackend().route(logits[:, :NUM_EXPERTS], routing, bias, 1,
                                                                 logits[:, NUM_EXPERTS:])
        assert ids.dtype == torch.int32, routing
        assert torch.equal(ids.long().cpu(), expected_ids.cpu()), routing
        torch.testing.assert_close(weights.cpu(), expected_weights.cpu(), rtol=1e-5, atol=1e-6)


def check_the_backend_passes_the_conformance_check(device):
    from weir.testing import check_moe_backend

    check_moe_backend(_backend(), device=device)


CHECKS = [
    check_routing_kernel_matches_the_reference,
    check_grouped_routing_kernel_matches_the_reference,
    check_backend_routes_each_method,
    check_alignment,
    check_matches_torch,
    check_shared_experts_match_torch,
    check_one_expert_takes_every_token,
    check_ragged_shapes_strides_and_tiles,
    check_every_activation_matches_torch,
    check_out_of_range_ids_contribute_nothing,
    check_no_tokens,
    check_the_backend_passes_the_conformance_check,
]


test_kernels_interpreted_on_cpu, test_kernels_on_cuda = kernel_check_tests("test_moe_triton", CHECKS)


def test_backend_declares_cuda_and_graphs():
    from weir.plugins.moe_backends.triton_fused import TritonMoEBackend

    assert TritonMoEBackend.name == "triton" and TritonMoEBackend.supports_cuda_graphs
    assert TritonMoEBackend.supports("cuda") and not TritonMoEBackend.supports("cpu")


def test_tile_table():
    kernels = _kernels()
    assert kernels.default_moe_tiles(8192, 10, 512, torch.float32) == kernels.FP32_TILES
    previous_block_m = 0
    for num_tokens in [1, 7, 51, 52, 256, 409, 410, 1024, 2048, 8192, 13107, 13108, 65536]:
        tiles = kernels.default_moe_tiles(num_tokens, 10, 512, torch.bfloat16)
        assert tiles.block_m >= previous_block_m, "bigger batches never get smaller row blocks"
        previous_block_m = tiles.block_m
        for size in (tiles.block_m, tiles.gate_up.block_n, tiles.gate_up.block_k, tiles.down.block_n,
                     tiles.down.block_k):
            assert size >= 16 and size & (size - 1) == 0, f"{tiles}: tl.dot needs powers of two >= 16"
    assert kernels.default_moe_tiles(1, 10, 512, torch.bfloat16).block_m == 16
    assert kernels.default_moe_tiles(8192, 10, 512, torch.bfloat16).block_m == 64
    assert kernels.default_moe_tiles(16384, 10, 512, torch.bfloat16).block_m == 128


def test_worst_case_block_count_covers_every_routing():
    rng = random.Random(0)
    max_padded_blocks = _kernels().max_padded_blocks
    for _ in range(500):
        num_experts, block_m = rng.choice([4, 8, 512]), rng.choice([16, 32, 64])
        num_assignments = rng.randint(1, 300)
        counts = [0] * num_experts
        for _ in range(num_assignments):  # skewed towards the first experts, with empty ones
            counts[min(int(rng.expovariate(0.5)), num_experts - 1)] += 1
        needed = sum(math.ceil(count / block_m) for count in counts)
        assert needed <= max_padded_blocks(num_assignments, num_experts, block_m)
    # One row on each of 10 experts needs exactly 10 blocks: the bound is tight there.
    assert max_padded_blocks(10, 512, 16) == 10


def test_bad_arguments_are_errors():
    backend = _backend()
    w_gate_up, w_down = _moe_weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE, "cpu")
    hidden = torch.randn(3, HIDDEN)
    topk_weights, topk_ids = torch.rand(3, TOP_K), torch.zeros(3, TOP_K, dtype=torch.int64)
    with pytest.raises(ValueError, match="unknown activation 'relu9'"):
        backend.experts(hidden, topk_weights, topk_ids, w_gate_up, w_down, "relu9")
    with pytest.raises(ValueError, match="do not match hidden size"):
        backend.experts(hidden[:, :40], topk_weights, topk_ids, w_gate_up, w_down)
    with pytest.raises(ValueError, match="must both be"):
        backend.experts(hidden, topk_weights[:2], topk_ids[:2], w_gate_up, w_down)
    with pytest.raises(ValueError, match="integer expert ids"):
        backend.experts(hidden, topk_weights, topk_ids.float(), w_gate_up, w_down)
    with pytest.raises(ValueError, match="must have hidden's dtype"):
        backend.experts(hidden.bfloat16(), topk_weights, topk_ids, w_gate_up, w_down)
    from weir.plugins.moe_backends.triton_routing_kernels import top_k_route_triton

    with pytest.raises(ValueError, match="computes softmax_top_k and top_k_softmax, not sigmoid_grouped_top_k"):
        top_k_route_triton(torch.randn(3, NUM_EXPERTS), ROUTINGS[-1])
    from weir.plugins.moe_backends.triton_routing_kernels import sigmoid_grouped_route_triton

    with pytest.raises(ValueError, match="grouped routing kernel computes sigmoid_grouped_top_k, not softmax_top_k"):
        sigmoid_grouped_route_triton(torch.randn(3, NUM_EXPERTS), torch.zeros(NUM_EXPERTS), ROUTINGS[0])
    with pytest.raises(ValueError, match=r"correction_bias must be float \[8\]"):
        sigmoid_grouped_route_triton(torch.randn(3, NUM_EXPERTS), torch.zeros(6), ROUTINGS[-1])
    with pytest.raises(ValueError, match=r"router_logits must be \[num_tokens, 8\]"):
        top_k_route_triton(torch.randn(3, 6), ROUTINGS[0])
    with pytest.raises(ValueError, match="needs the layer's correction_bias"):
        backend.route(torch.randn(3, NUM_EXPERTS), ROUTINGS[-1])
    with pytest.raises(ValueError, match="softmax_top_k routing takes no correction_bias"):
        backend.route(torch.randn(3, NUM_EXPERTS), ROUTINGS[0], torch.zeros(NUM_EXPERTS))


def test_the_kernel_has_every_activation_of_the_table():
    from weir.moe import ACTIVATIONS
    from weir.plugins.moe_backends.triton_fused import KERNEL_ACTIVATIONS

    assert set(KERNEL_ACTIVATIONS) == set(ACTIVATIONS)


@pytest.fixture(scope="module")
def qwen3_next_experts():
    """bf16 experts at Qwen3-Next-80B shapes (3.2 GB), made on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    w_gate_up = torch.randn(512, 2 * 512, 2048, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    w_down = torch.randn(512, 2048, 512, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    return w_gate_up, w_down


def _qwen3_next_batch(num_tokens, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, 2048, device="cuda", dtype=torch.bfloat16, generator=generator)
    router_logits = torch.randn(num_tokens, 512, device="cuda", dtype=torch.bfloat16, generator=generator)
    topk_weights, topk_ids = softmax_top_k(router_logits, 10, renormalize=True)
    return hidden, topk_weights, topk_ids


def _relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 1024, 1400, 2048, 8192, 16384])  # every tile-table row
def test_qwen3_next_shapes_bf16(qwen3_next_experts, num_tokens):
    hidden, topk_weights, topk_ids = _qwen3_next_batch(num_tokens, seed=num_tokens)
    expected = TorchMoEBackend().experts(hidden, topk_weights, topk_ids, *qwen3_next_experts)
    actual = _backend().experts(hidden, topk_weights, topk_ids, *qwen3_next_experts)
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    assert _relative_error(actual, expected) < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [7, 256])
def test_cuda_graph_replay_matches_eager(qwen3_next_experts, num_tokens):
    backend = _backend()
    static_inputs = _qwen3_next_batch(num_tokens, seed=1)
    backend.experts(*static_inputs, *qwen3_next_experts)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.experts(*static_inputs, *qwen3_next_experts)
    # New routings after capture, one sending every token to the same ten experts: group sizes
    # and block counts differ from the captured step, and nothing of them was baked in.
    hot_ids = torch.arange(10, device="cuda").repeat(num_tokens, 1)
    new_batches = [_qwen3_next_batch(num_tokens, seed=2), (*_qwen3_next_batch(num_tokens, seed=3)[:2], hot_ids)]
    for batch in new_batches:
        for static, new in zip(static_inputs, batch):
            static.copy_(new)
        graph.replay()
        eager = backend.experts(*batch, *qwen3_next_experts)
        # Each row's result is independent of its place in its group: replay is bit-exact.
        assert torch.equal(graph_out, eager)
        expected = TorchMoEBackend().experts(*batch, *qwen3_next_experts)
        assert _relative_error(graph_out, expected) < 1e-2


@cuda
@pytest.mark.gpu
def test_every_routing_never_syncs_and_replays_from_a_cuda_graph(qwen3_next_experts):
    """Routing and experts for each method at Qwen3-Next sizes (512 experts, top 10; DeepSeek's
    8 groups, 4 kept): no host sync (torch's sync debug mode raises on one), and a graph captured
    once replays new logits bit-exactly as eager runs them."""
    backend = _backend()
    generator = torch.Generator(device="cuda").manual_seed(7)
    bias = torch.randn(512, device="cuda", generator=generator) * 0.05
    for routing in (Routing.softmax_top_k(512, 10, True), Routing.top_k_softmax(512, 10),
                    Routing.sigmoid_grouped_top_k(512, 10, 8, 4, True, 2.5)):
        correction_bias = bias if routing.uses_correction_bias else None
        hidden = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16, generator=generator)
        logits = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, generator=generator)
        forward = lambda: backend.forward(hidden, logits, *qwen3_next_experts, routing,  # noqa: E731
                                          correction_bias=correction_bias)
        forward()  # compiles outside the capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            forward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = forward()
        logits.copy_(torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, generator=generator))
        graph.replay()
        assert torch.equal(graph_out, forward()), routing
