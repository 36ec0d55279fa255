"""Top-k routing in one Triton kernel per method (``weir.moe.Routing``).

torch spends five launches on softmax top-k (fp32 softmax, top-k gather, a sort, the
renormalising sum and divide): its softmax, top-k and sort kernels alone took 22 us per layer
at a 256-token decode step of the 512-expert qwen3-next-24l on an H200
(benchmarks/profile_steps.py). Here one program per token loads its router logits and picks the
top ``k`` by repeated argmax over fp32 scores (ties go to the lower expert id), keeping the
weights in registers: for ``softmax_top_k`` the scores are the softmax over all experts
(optionally renormalised over the chosen ``k``), for ``top_k_softmax`` the logits themselves,
whose chosen ``k`` then take a softmax of their own. ``sigmoid_grouped_top_k`` (DeepSeek-V3,
Kimi) is a kernel of its own: torch spends a dozen launches a layer on it (sigmoid, bias, the
groups' top-2 sums, their top-k, the mask, the experts' top-k, the gather and the scaling), and
Kimi Linear has 26 such layers a step. Weights come out fp32 and sorted descending by the
score that chose them, as ``torch.topk``'s. Shared experts (``weir.moe.append_shared_experts``)
take the slots after the top ``k``, with ``sigmoid(gate logit)`` weights (1 without gate
logits), in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.moe import (SIGMOID_GROUPED_TOP_K, SOFTMAX_TOP_K, TOP_K_SOFTMAX, Routing, check_router_inputs,
                      check_shared_gate_logits)

FUSED_ROUTING_METHODS = (SOFTMAX_TOP_K, TOP_K_SOFTMAX)


@triton.jit(do_not_specialize=["num_tokens"])
def _top_k_route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits,
    shared_gate_ptr, stride_shared_gate,  # [num_tokens, NUM_SHARED] logits, read when HAS_SHARED_GATE
    TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, BLOCK_E: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, HAS_SHARED_GATE: tl.constexpr,
):
    token = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token.to(tl.int64) * stride_logits + experts, mask=valid,
                     other=float("-inf")).to(tl.float32)  # [E]
    # A taken expert drops to the bottom (-1 is below every probability; -inf below every finite
    # logit); so do NaNs (a NaN or inf logit), so that the ids stay in range whatever the logits
    # hold: on a tie at the bottom the lowest id, always a real expert, wins.
    if SOFTMAX_FIRST:
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        probs = shifted / tl.sum(shifted, axis=0)  # [E]; padded experts are exactly 0
        remaining = tl.where(valid & (probs == probs), probs, -1.0)
    else:
        remaining = tl.where(valid & (logits == logits), logits, float("-inf"))
    slots = tl.arange(0, TOP_K_P)
    top_weights = tl.zeros([TOP_K_P], tl.float32)
    top_ids = tl.zeros([TOP_K_P], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, experts, BLOCK_E), axis=0)
        top_weights = tl.where(slots == slot, best, top_weights)
        top_ids = tl.where(slots == slot, best_id, top_ids)
        if SOFTMAX_FIRST:
            remaining = tl.where(experts == best_id, -1.0, remaining)
        else:
            remaining = tl.where(experts == best_id, float("-inf"), remaining)
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            top_weights = top_weights / tl.sum(top_weights, axis=0)  # padded slots hold 0
    else:
        # The chosen logits' own softmax; slot 0 holds the largest, padded slots add nothing.
        largest = tl.max(tl.where(slots < TOP_K, top_weights, float("-inf")), axis=0)
        shifted_top = tl.where(slots < TOP_K, tl.exp(top_weights - largest), 0.0)
        top_weights = shifted_top / tl.sum(shifted_top, axis=0)
    _store_slots(weights_ptr, ids_ptr, token, top_weights, top_ids, num_experts, shared_gate_ptr,
                 stride_shared_gate, TOP_K, TOP_K_P, NUM_SHARED, HAS_SHARED_GATE)


@triton.jit
def _store_slots(weights_ptr, ids_ptr, token, top_weights, top_ids, num_experts, shared_gate_ptr, stride_shared_gate,
                 TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, NUM_SHARED: tl.constexpr, HAS_SHARED_GATE: tl.constexpr):
    """A token's row of ``[TOP_K + NUM_SHARED]`` slots: the chosen ``TOP_K``, then the shared experts."""
    slots = tl.arange(0, TOP_K_P)
    row = token.to(tl.int64) * (TOP_K + NUM_SHARED)
    tl.store(weights_ptr + row + slots, top_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row + slots, top_ids, mask=slots < TOP_K)
    for shared in tl.static_range(NUM_SHARED):
        weight = 1.0
        if HAS_SHARED_GATE:
            weight = tl.sigmoid(tl.load(shared_gate_ptr + token.to(tl.int64) * stride_shared_gate + shared)
                                .to(tl.float32))
        tl.store(weights_ptr + row + TOP_K + shared, weight)
        tl.store(ids_ptr + row + TOP_K + shared, num_experts + shared)


@triton.jit(do_not_specialize=["num_tokens"])
def _sigmoid_grouped_route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_logits, routed_scaling_factor,
    shared_gate_ptr, stride_shared_gate,  # [num_tokens, NUM_SHARED] logits, read when HAS_SHARED_GATE
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr,
    TOP_K_GROUPS: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, RENORMALIZE: tl.constexpr,
    NUM_SHARED: tl.constexpr, HAS_SHARED_GATE: tl.constexpr,
):
    """``sigmoid_grouped_top_k`` for one token, the experts held as a ``[groups, group size]`` tile."""
    NUM_EXPERTS: tl.constexpr = NUM_GROUPS * GROUP_SIZE
    token = tl.program_id(0)
    groups = tl.arange(0, GROUPS_P)
    members = tl.arange(0, GROUP_P)
    valid = (groups[:, None] < NUM_GROUPS) & (members[None, :] < GROUP_SIZE)  # [G, S]
    experts = tl.where(valid, groups[:, None] * GROUP_SIZE + members[None, :], NUM_EXPERTS)  # [G, S]
    logits = tl.load(logits_ptr + token.to(tl.int64) * stride_logits + experts, mask=valid,
                     other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)  # [G, S]: the weights
    choice = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    # NaNs (from a NaN logit or bias) rank lowest. Picks come only from what is still open (real,
    # kept, not yet taken), so however many scores are -inf the ids stay distinct and in range.
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))
    eligible = valid  # [G, S]
    if TOP_K_GROUPS < NUM_GROUPS:  # with every group kept, the group step masks nothing
        # A group's score: its two largest choice scores (the first one's lowest position dropped
        # for the second, so a tie counts twice, as torch.topk(2) does).
        first = tl.max(choice, axis=1)  # [G]
        first_at = tl.min(tl.where(choice == first[:, None], members[None, :], GROUP_P), axis=1)
        second = tl.max(tl.where(members[None, :] == first_at[:, None], float("-inf"), choice), axis=1)
        group_scores = first + second
        group_scores = tl.where(group_scores == group_scores, group_scores, float("-inf"))
        kept = groups < 0  # [G] all False
        for _ in tl.static_range(TOP_K_GROUPS):
            open_groups = (groups < NUM_GROUPS) & ~kept
            best = tl.max(tl.where(open_groups, group_scores, float("-inf")), axis=0)
            best_group = tl.min(tl.where(open_groups & (group_scores == best), groups, GROUPS_P), axis=0)
            kept = kept | (groups == best_group)
        eligible = valid & kept[:, None]
    slots = tl.arange(0, TOP_K_P)
    top_weights = tl.zeros([TOP_K_P], tl.float32)
    top_ids = tl.zeros([TOP_K_P], tl.int32)
    taken = experts < 0  # [G, S] all False
    for slot in tl.static_range(TOP_K):
        open_experts = eligible & ~taken
        best = tl.max(tl.max(tl.where(open_experts, choice, float("-inf")), axis=1), axis=0)
        best_id = tl.min(tl.min(tl.where(open_experts & (choice == best), experts, NUM_EXPERTS), axis=1), axis=0)
        picked = experts == best_id  # [G, S]: one expert
        weight = tl.sum(tl.sum(tl.where(picked, scores, 0.0), axis=1), axis=0)
        top_weights = tl.where(slots == slot, weight, top_weights)
        top_ids = tl.where(slots == slot, best_id, top_ids)
        taken = taken | picked
    if RENORMALIZE:
        top_weights = top_weights / (tl.sum(top_weights, axis=0) + 1e-20)  # padded slots hold 0
    top_weights = top_weights * routed_scaling_factor
    _store_slots(weights_ptr, ids_ptr, token, top_weights, top_ids, NUM_EXPERTS, shared_gate_ptr,
                 stride_shared_gate, TOP_K, TOP_K_P, NUM_SHARED, HAS_SHARED_GATE)


def _routing_outputs(
    router_logits: torch.Tensor, routing: Routing, num_shared: int, shared_gate_logits: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Contiguous-row logits and gate logits, and the empty ``[num_tokens, top_k + num_shared]``
    weights (fp32) and ids (int32) a routing kernel fills."""
    num_tokens = router_logits.shape[0]
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    if shared_gate_logits is not None:
        check_shared_gate_logits(shared_gate_logits, num_tokens, num_shared)
        if shared_gate_logits.stride(-1) != 1:
            shared_gate_logits = shared_gate_logits.contiguous()
    slots = routing.top_k + num_shared
    weights = torch.empty((num_tokens, slots), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, slots), dtype=torch.int32, device=router_logits.device)
    return router_logits, shared_gate_logits, weights, ids


def top_k_route_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    routing: Routing,  # softmax_top_k or top_k_softmax
    num_shared: int = 0,
    shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int32), each ``[num_tokens, top_k + num_shared]``, as
    ``weir.moe.route_reference`` and then ``weir.moe.append_shared_experts`` compute them."""
    if routing.method not in FUSED_ROUTING_METHODS:
        raise ValueError(f"the fused routing kernel computes {' and '.join(FUSED_ROUTING_METHODS)}, "
                         f"not {routing.method}")
    check_router_inputs(router_logits, routing, None)
    num_tokens, num_experts = router_logits.shape
    router_logits, shared_gate_logits, weights, ids = _routing_outputs(router_logits, routing, num_shared,
                                                                       shared_gate_logits)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    _top_k_route_kernel[(num_tokens,)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
        *_shared_gate_args(shared_gate_logits, router_logits),
        TOP_K=routing.top_k, TOP_K_P=triton.next_power_of_2(routing.top_k), BLOCK_E=block_e,
        SOFTMAX_FIRST=routing.method == SOFTMAX_TOP_K, RENORMALIZE=routing.renormalize,
        NUM_SHARED=num_shared, HAS_SHARED_GATE=shared_gate_logits is not None, num_warps=_route_warps(block_e),
    )
    return weights, ids


def sigmoid_grouped_route_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    correction_bias: torch.Tensor,  # [num_experts]
    routing: Routing,  # sigmoid_grouped_top_k
    num_shared: int = 0,
    shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int32), each ``[num_tokens, top_k + num_shared]``, as
    ``weir.moe.route_reference`` and then ``weir.moe.append_shared_experts`` compute them."""
    if routing.method != SIGMOID_GROUPED_TOP_K:
        raise ValueError(f"the grouped routing kernel computes {SIGMOID_GROUPED_TOP_K}, not {routing.method}")
    check_router_inputs(router_logits, routing, correction_bias)
    num_tokens, num_experts = router_logits.shape
    router_logits, shared_gate_logits, weights, ids = _routing_outputs(router_logits, routing, num_shared,
                                                                       shared_gate_logits)
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // routing.num_groups
    groups_p, group_p = triton.next_power_of_2(routing.num_groups), triton.next_power_of_2(group_size)
    _sigmoid_grouped_route_kernel[(num_tokens,)](
        router_logits, correction_bias.contiguous(), weights, ids, num_tokens, router_logits.stride(0),
        routing.routed_scaling_factor, *_shared_gate_args(shared_gate_logits, router_logits),
        NUM_GROUPS=routing.num_groups, GROUP_SIZE=group_size, GROUPS_P=groups_p, GROUP_P=group_p,
        TOP_K_GROUPS=routing.top_k_groups, TOP_K=routing.top_k, TOP_K_P=triton.next_power_of_2(routing.top_k),
        RENORMALIZE=routing.renormalize, NUM_SHARED=num_shared, HAS_SHARED_GATE=shared_gate_logits is not None,
        num_warps=_route_warps(groups_p * group_p),
    )
    return weights, ids


def _shared_gate_args(shared_gate_logits: torch.Tensor | None, router_logits: torch.Tensor) -> tuple:
    """The kernels' (shared gate pointer, its row stride): any tensor and 0 when there are no gate logits
    (``HAS_SHARED_GATE`` off, never read)."""
    if shared_gate_logits is None:
        return router_logits, 0
    return shared_gate_logits, shared_gate_logits.stride(0)


def _route_warps(block_e: int) -> int:
    return 1 if block_e <= 512 else (2 if block_e <= 1024 else 4)
