"""Softmax top-k routing in one Triton kernel (the Triton MoE backend's ``forward``).

torch spends five launches on it (fp32 softmax, top-k gather, a sort, the renormalising sum
and divide): its softmax, top-k and sort kernels alone took 22 us per layer at a 256-token
decode step of the 512-expert qwen3-next-24l on an H200 (scripts/profile_steps.py). Here one
program per token loads its router logits, takes the fp32 softmax, and picks the top ``k`` by
repeated argmax (ties go to the lower expert id), keeping the weights in registers until the
optional renormalisation. Weights come out fp32 and sorted descending, as ``torch.topk``'s.
Shared experts (``weir.moe.append_shared_experts``) take the slots after the top ``k``, with
``sigmoid(gate logit)`` weights, in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.moe import check_shared_gate_logits


@triton.jit(do_not_specialize=["num_tokens"])
def _softmax_top_k_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits,
    shared_gate_ptr, stride_shared_gate,  # [num_tokens, NUM_SHARED] logits, read when HAS_SHARED_GATE
    TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
    NUM_SHARED: tl.constexpr, HAS_SHARED_GATE: tl.constexpr,
):
    token = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token.to(tl.int64) * stride_logits + experts, mask=valid,
                     other=float("-inf")).to(tl.float32)  # [E]
    shifted = tl.exp(logits - tl.max(logits, axis=0))
    probs = shifted / tl.sum(shifted, axis=0)  # [E]; padded experts are exactly 0
    # A taken expert drops to -1, below every probability; so do NaNs (a NaN or inf logit), so
    # that the ids stay in range whatever the logits hold.
    remaining = tl.where(valid & (probs == probs), probs, -1.0)
    slots = tl.arange(0, TOP_K_P)
    top_weights = tl.zeros([TOP_K_P], tl.float32)
    top_ids = tl.zeros([TOP_K_P], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, experts, BLOCK_E), axis=0)
        top_weights = tl.where(slots == slot, best, top_weights)
        top_ids = tl.where(slots == slot, best_id, top_ids)
        remaining = tl.where(experts == best_id, -1.0, remaining)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)  # padded slots hold 0
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


def softmax_top_k_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    num_shared: int = 0,
    shared_gate_logits: torch.Tensor | None = None,  # [num_tokens, num_shared]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int32), each ``[num_tokens, top_k + num_shared]``, as
    ``weir.moe.softmax_top_k`` and then ``weir.moe.append_shared_experts`` compute them."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
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
    _softmax_top_k_kernel[(num_tokens,)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
        shared_gate_logits if has_gate else router_logits, shared_gate_logits.stride(0) if has_gate else 0,
        TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k), BLOCK_E=block_e, RENORMALIZE=renormalize,
        NUM_SHARED=num_shared, HAS_SHARED_GATE=has_gate,
        num_warps=1 if block_e <= 512 else (2 if block_e <= 1024 else 4),
    )
    return weights, ids
