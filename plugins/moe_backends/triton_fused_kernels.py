"""Triton kernels of the fused MoE backend: expert alignment, two grouped GEMMs, the slot sum.

An *assignment* is one (token, slot) pair of ``topk_ids [num_tokens, top_k]``, numbered
``token * top_k + slot``. The alignment lists the assignments grouped by expert, each group
padded to a multiple of ``BLOCK_M`` with the sentinel ``num_assignments``, so every BLOCK_M
block of the list belongs to one expert. Each GEMM program then takes one block and one column
tile: the first computes ``act(x @ gate^T) * (x @ up^T)`` for the block's tokens (gate and up
tiles side by side, so no ``[num_assignments, 2 * intermediate]`` buffer), the second
``routing weight * (h @ down^T)``; both write rows indexed by assignment, so the last kernel
sums a token's ``top_k`` rows in a fixed order and no result depends on the order in a group.

Nothing reads the device on the host: buffers are sized for the worst case from ``num_tokens``,
grids depend only on it, and blocks past the device-side padded total return at once, so a
launch for a fixed token count can be captured in a CUDA graph. Rounding follows the torch
reference: gate, up and SiLU round to the model dtype before the product; the routing weight,
rounded to the model dtype as torch does, scales the fp32 down output before it rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ASSIGNMENTS_PER_PROGRAM = 256  # counting and scattering ids: small, fixed, any num_tokens


@dataclass(frozen=True)
class GemmTiles:
    """Tile sizes and launch shape of one grouped GEMM (block_n output columns, block_k reduction)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoETiles:
    """Rows per block (also each expert group's alignment) and the tiles of the two GEMMs."""

    block_m: int
    gate_up: GemmTiles  # block_n counts columns of gate (and as many of up) per program
    down: GemmTiles


# (largest mean assignments per expert, tiles): the first row whose bound covers the batch wins.
# The mean is what decides how full a block is; for Qwen3-Next (E=512, k=10) the rows switch at
# about 51, 409, 1229, 1638 and 13107 tokens. Values are starting points for H100/H200-class GPUs, checked
# by benchmarks/kernel_bench/bench_moe.py --sweep; no autotuning, so start-up compiles one config per tier.
BF16_TILE_TABLE: tuple[tuple[float, MoETiles], ...] = (
    # Decode: a touched expert gets ~1 row, so time is weight streaming. 16 rows is the smallest
    # tensor-core tile; narrow column tiles spread one expert's weights over many programs so a
    # batch touching few experts still keeps every SM loading.
    (1.0, MoETiles(16, GemmTiles(32, 128, 4, 4), GemmTiles(64, 128, 4, 4))),
    # Small batches: most experts get a few rows, still one block each; wider tiles, fewer programs.
    (8.0, MoETiles(16, GemmTiles(64, 128, 4, 3), GemmTiles(128, 128, 8, 3))),
    # Large decode batches (DeepSeek-V3 and Kimi Linear at 256-512 tokens, Qwen3-Next at 512-1024):
    # 32 rows with the small batches' deep-K GEMMs. H200, bench_moe.py --sweep, against the next
    # row's tiles: 2-6% faster at every batch swept with 9-20 rows per expert (DeepSeek-V3 5.48
    # vs 5.80 ms at 384 tokens, Kimi Linear 0.95 vs 0.98 ms at 512, Qwen3-Next 0.87 vs 0.89 ms
    # at 1024; at some of them 16-row blocks were faster still, by 1-2%); at 31 rows (Qwen3-Next,
    # 1600 tokens) it was not among the five fastest.
    (24.0, MoETiles(32, GemmTiles(64, 128, 4, 3), GemmTiles(128, 128, 8, 3))),
    (32.0, MoETiles(32, GemmTiles(64, 64, 4, 3), GemmTiles(128, 64, 4, 3))),
    # Prefill: compute-bound-ish. 64 rows keep padding waste low at ~160 rows per expert (8192
    # tokens); the gate/up kernel holds two 64x64 fp32 accumulators, as much as 4 warps hold well.
    (256.0, MoETiles(64, GemmTiles(64, 64, 4, 3), GemmTiles(128, 64, 4, 3))),
    # Full prefill chunks (16384 tokens: ~320 rows per expert): 128-row blocks and 8 warps double
    # the reuse of each loaded tile. H200, benchmarks/kernel_bench/bench_moe.py --sweep: 3.22 ms vs 3.87 ms (the
    # 64-row tiles) per Qwen3-Next layer at 16384 tokens, 320 vs 267 TFLOP/s; at 2048 tokens (40
    # rows) the 64-row tiles stay the fastest. The switch at 256 rows is a guess between the two:
    # 8192 tokens (160 rows, 2 blocks of 128 would be 62% full) was not swept.
    (float("inf"), MoETiles(128, GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 3))),
)
# Exact fp32 dots (tests, reference runs) need small tiles to stay out of register spills.
FP32_TILES = MoETiles(16, GemmTiles(32, 32, 4, 2), GemmTiles(32, 32, 4, 2))


def default_moe_tiles(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoETiles:
    """The tiles for a batch, from host-known sizes only (a CUDA graph fixes num_tokens)."""
    if dtype == torch.float32:
        return FP32_TILES
    mean_rows_per_expert = num_tokens * top_k / num_experts
    for bound, tiles in BF16_TILE_TABLE:
        if mean_rows_per_expert <= bound:
            return tiles
    raise AssertionError("the last tile row has no bound")


def max_padded_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Blocks the aligned list can need: each non-empty expert wastes at most block_m - 1 slots.

    At most ``min(num_experts, num_assignments)`` experts are non-empty, a tighter bound than
    ``num_experts`` for decode (10 blocks instead of 480 for one Qwen3-Next token).
    """
    return (num_assignments + min(num_experts, num_assignments) * (block_m - 1)) // block_m


@triton.jit(do_not_specialize=["num_assignments"])
def _count_experts_kernel(topk_ids_ptr, counts_ptr, num_assignments, num_experts, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] assignment numbers
    ids = tl.load(topk_ids_ptr + offsets, mask=offsets < num_assignments, other=-1).to(tl.int32)
    # Out-of-range ids are dropped here rather than written out of bounds (a check would sync).
    valid = (ids >= 0) & (ids < num_experts)
    tl.atomic_add(counts_ptr + ids, 1, mask=valid)


@triton.jit(do_not_specialize=["num_assignments"])
def _expert_offsets_kernel(
    counts_ptr,  # [num_experts] assignments per expert
    cursor_ptr,  # [num_experts] out: first slot of each expert's group
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_assignments, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """One program per expert: its group's start, its blocks' expert ids, its sentinel padding."""
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BLOCK_E]
    start = tl.sum(tl.where(experts < expert, padded, 0))
    count = tl.load(counts_ptr + expert)
    end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(cursor_ptr + expert, start)
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded))
    for block_start in range(start // BLOCK_M, end // BLOCK_M, BLOCK_B):
        blocks = block_start + tl.arange(0, BLOCK_B)
        tl.store(expert_ids_ptr + blocks, tl.full([BLOCK_B], 0, tl.int32) + expert, mask=blocks < end // BLOCK_M)
    padding_slots = start + count + tl.arange(0, BLOCK_M)  # the group's tail after its assignments
    sentinel = tl.full([BLOCK_M], 0, tl.int32) + num_assignments
    tl.store(sorted_ids_ptr + padding_slots, sentinel, mask=padding_slots < end)


@triton.jit(do_not_specialize=["num_assignments"])
def _scatter_assignments_kernel(topk_ids_ptr, cursor_ptr, sorted_ids_ptr, num_assignments, num_experts,
                                BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] assignment numbers
    ids = tl.load(topk_ids_ptr + offsets, mask=offsets < num_assignments, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < num_experts)
    # The order inside a group is whatever the atomics give; results never depend on it.
    slots = tl.atomic_add(cursor_ptr + ids, 1, mask=valid)
    tl.store(sorted_ids_ptr + slots, offsets, mask=valid)


def align_assignments(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the assignments by expert, each group padded to a multiple of ``block_m``.

    Returns int32 ``sorted_token_ids [max_blocks * block_m]`` (assignment numbers, sentinel
    ``num_assignments`` in the padding), ``expert_ids [max_blocks]`` (the expert of each block)
    and ``num_tokens_post_padded [1]``; entries past the padded total are not written.
    """
    num_assignments = topk_ids.numel()
    flat_ids = topk_ids.reshape(-1).contiguous()  # [num_assignments]
    max_blocks = max_padded_blocks(num_assignments, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    if num_assignments == 0:
        num_padded.zero_()
        return sorted_ids, expert_ids, num_padded
    id_grid = (triton.cdiv(num_assignments, ASSIGNMENTS_PER_PROGRAM),)
    _count_experts_kernel[id_grid](flat_ids, counts, num_assignments, num_experts, BLOCK=ASSIGNMENTS_PER_PROGRAM)
    _expert_offsets_kernel[(num_experts,)](
        counts, cursor, sorted_ids, expert_ids, num_padded, num_assignments, num_experts,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=64,
    )
    _scatter_assignments_kernel[id_grid](flat_ids, cursor, sorted_ids, num_assignments, num_experts,
                                         BLOCK=ASSIGNMENTS_PER_PROGRAM)
    return sorted_ids, expert_ids, num_padded


@triton.jit
def _activate(gate, ACTIVATION: tl.constexpr):
    """``F.silu`` / ``F.gelu`` (erf form) / ``F.gelu(approximate="tanh")`` of fp32 ``gate``, as
    torch computes them in fp32 (up to rounding)."""
    if ACTIVATION == "silu":
        return tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    elif ACTIVATION == "gelu":
        return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) * (...)
        # tanh(y) = 1 - 2 / (exp(2y) + 1): exp overflowing to inf still gives 1.
        return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))


@triton.jit(do_not_specialize=["num_assignments"])
def _gate_up_kernel(
    hidden_ptr, stride_hidden,  # [num_tokens, hidden_size], last stride 1
    w_ptr, stride_w_expert, stride_w_row, stride_w_col,  # [num_experts, 2 * intermediate, hidden_size]
    act_ptr,  # [num_assignments, intermediate], contiguous: act(gate) * up per assignment
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_assignments, hidden_size, intermediate,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (block of one expert's assignments, column tile of the intermediate)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    assignments = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_valid = assignments < num_assignments
    tokens = (assignments // TOP_K).to(tl.int64)
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_valid = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + tokens[:, None] * stride_hidden + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # W[e] is [rows, hidden] with hidden contiguous; the tile is read as [BLOCK_K, BLOCK_N] = W^T.
    gate_ptrs = (w_ptr + expert * stride_w_expert + cols[None, :] * stride_w_row
                 + ks[:, None] * stride_w_col)  # [BLOCK_K, BLOCK_N]
    up_offset = intermediate * stride_w_row  # up rows follow the gate rows
    gate_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, hidden_size, BLOCK_K):
        x_mask = row_valid[:, None]
        w_mask = col_valid[None, :]
        if not EVEN_K:
            k_valid = ks < hidden_size - k_start
            x_mask = x_mask & k_valid[None, :]
            w_mask = w_mask & k_valid[:, None]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up_w = tl.load(gate_ptrs + up_offset, mask=w_mask, other=0.0)
        gate_acc = tl.dot(x, gate_w, gate_acc, input_precision=PRECISION)
        up_acc = tl.dot(x, up_w, up_acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_w_col
    dtype = act_ptr.dtype.element_ty
    gate = gate_acc.to(dtype).to(tl.float32)
    up = up_acc.to(dtype).to(tl.float32)
    activated = _activate(gate, ACTIVATION).to(dtype).to(tl.float32)
    out_ptrs = act_ptr + assignments.to(tl.int64)[:, None] * intermediate + cols[None, :]
    tl.store(out_ptrs, (activated * up).to(dtype), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit(do_not_specialize=["num_assignments"])
def _down_kernel(
    act_ptr,  # [num_assignments, intermediate], contiguous
    w_ptr, stride_w_expert, stride_w_row, stride_w_col,  # [num_experts, hidden_size, intermediate]
    out_ptr,  # [num_assignments, hidden_size], contiguous: weighted expert output per assignment
    weights_ptr,  # [num_assignments] routing weights
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_assignments, hidden_size, intermediate,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (block of one expert's assignments, column tile of the hidden size)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    assignments = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_valid = assignments < num_assignments
    rows = assignments.to(tl.int64)
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_valid = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * intermediate + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = (w_ptr + expert * stride_w_expert + cols[None, :] * stride_w_row
              + ks[:, None] * stride_w_col)  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, intermediate, BLOCK_K):
        a_mask = row_valid[:, None]
        w_mask = col_valid[None, :]
        if not EVEN_K:
            k_valid = ks < intermediate - k_start
            a_mask = a_mask & k_valid[None, :]
            w_mask = w_mask & k_valid[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_col
    dtype = out_ptr.dtype.element_ty
    routing_weight = tl.load(weights_ptr + rows, mask=row_valid, other=0.0).to(dtype).to(tl.float32)
    # Not rounded before the weight as torch does: with that extra rounding ptxas serialises the
    # wgmma pipeline of the loop above (warning C7514), and skipping it only removes error.
    weighted = acc * routing_weight[:, None]
    out_ptrs = out_ptr + rows[:, None] * hidden_size + cols[None, :]
    tl.store(out_ptrs, weighted.to(dtype), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _sum_slots_kernel(
    expert_out_ptr,  # [num_tokens * TOP_K, hidden_size]
    topk_ids_ptr,  # [num_tokens * TOP_K]
    out_ptr,  # [num_tokens, hidden_size]
    hidden_size, num_experts,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col_valid = cols < hidden_size
    total = tl.zeros([BLOCK_H], tl.float32)
    for slot in tl.static_range(TOP_K):  # fixed slot order: the sum is deterministic
        assignment = token * TOP_K + slot
        expert = tl.load(topk_ids_ptr + assignment)
        # A dropped (out-of-range) id's row was never written; it must not be read.
        in_range = (expert >= 0) & (expert < num_experts)
        readable = cols < tl.where(in_range, hidden_size, 0)
        row = tl.load(expert_out_ptr + assignment * hidden_size + cols, mask=readable, other=0.0)
        total += row.to(tl.float32)
    tl.store(out_ptr + token * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=col_valid)


def fused_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids
    w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]
    w_down: torch.Tensor,  # [num_experts, hidden_size, intermediate]
    activation: str,  # "silu", "gelu" or "gelu_tanh"
    tiles: MoETiles,
) -> torch.Tensor:  # [num_tokens, hidden_size], hidden's dtype
    """Sum over each token's experts of ``weight * down(act(gate(x)) * up(x))``; shapes pre-checked."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts, intermediate = w_down.shape[0], w_down.shape[2]
    num_assignments = num_tokens * top_k
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    flat_ids = topk_ids.reshape(-1).contiguous()  # [num_assignments]
    flat_weights = topk_weights.reshape(-1).contiguous()  # [num_assignments]
    block_m = tiles.block_m
    sorted_ids, expert_ids, num_padded = align_assignments(flat_ids, num_experts, block_m)
    max_blocks = expert_ids.shape[0]
    precision = "ieee" if hidden.dtype == torch.float32 else None
    block_lists = (sorted_ids, expert_ids, num_padded)

    activated = torch.empty(num_assignments, intermediate, dtype=hidden.dtype, device=hidden.device)
    gate_up = tiles.gate_up
    _gate_up_kernel[(max_blocks, triton.cdiv(intermediate, gate_up.block_n))](
        hidden, hidden.stride(0), w_gate_up, *w_gate_up.stride(), activated, *block_lists,
        num_assignments, hidden_size, intermediate,
        TOP_K=top_k, ACTIVATION=activation, EVEN_K=hidden_size % gate_up.block_k == 0, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=gate_up.block_n, BLOCK_K=gate_up.block_k,
        num_warps=gate_up.num_warps, num_stages=gate_up.num_stages,
    )
    expert_out = torch.empty(num_assignments, hidden_size, dtype=hidden.dtype, device=hidden.device)
    down = tiles.down
    _down_kernel[(max_blocks, triton.cdiv(hidden_size, down.block_n))](
        activated, w_down, *w_down.stride(), expert_out, flat_weights, *block_lists,
        num_assignments, hidden_size, intermediate,
        EVEN_K=intermediate % down.block_k == 0, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        num_warps=down.num_warps, num_stages=down.num_stages,
    )
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        expert_out, flat_ids, out, hidden_size, num_experts, TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out
