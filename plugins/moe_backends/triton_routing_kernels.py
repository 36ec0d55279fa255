"""Top-k routing in one Triton kernel: ``softmax_top_k`` and ``top_k_softmax`` (``weir.moe.Routing``).

torch spends five launches on softmax top-k (fp32 softmax, top-k gather, a sort, the
renormalising sum and divide): its softmax, top-k and sort kernels alone took 22 us per layer
at a 256-token decode step of the 512-expert qwen3-next-24l on an H200
(benchmarks/profile_steps.py). Here one program per token loads its router logits and picks the
top ``k`` by repeated argmax over fp32 scores (ties go to the lower expert id), keeping the
weights in registers: for ``softmax_top_k`` the scores are the softmax over all experts
(optionally renormalised over the chosen ``k``), for ``top_k_softmax`` the logits themselves,
whose chosen ``k`` then take a softmax of their own. Weights come out fp32 and sorted
descending, as ``torch.topk``'s. Shared experts (``weir.moe.append_shared_experts``) take the
slots after the top ``k``, with ``sigmoid(gate logit)`` weights, in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.moe import SOFTMAX_TOP_K, TOP_K_SOFTMAX, Routing, check_router_inputs, check_shared_gate_logits

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
    top_k = routing.top_k
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    if shared_gate_logits is not None:
        check_shared_gate_logits(shared_gate_logits, num_tokens, num_shared)
        if shared_gate_logits.stride(-1) != 1:
            shared_gate_logits = shared_gate_logits.contiguous()
    weights = torch.empty((num_tokens, top_k + num_shared), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k + num_shared), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    has_gate = shared_gate_logits is not None
    _top_k_route_kernel[(num_tokens,)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
        shared_gate_logits if has_gate else router_logits, shared_gate_logits.stride(0) if has_gate else 0,
        TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k), BLOCK_E=block_e,
        SOFTMAX_FIRST=routing.method == SOFTMAX_TOP_K, RENORMALIZE=routing.renormalize,
        NUM_SHARED=num_shared, HAS_SHARED_GATE=has_gate,
        num_warps=1 if block_e <= 512 else (2 if block_e <= 1024 else 4),
    )
    return weights, ids
