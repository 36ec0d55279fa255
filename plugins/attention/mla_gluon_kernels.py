"""The MLA attention kernel in Gluon, for Hopper's warpgroup MMA (wgmma): the same contract as
``mla_triton_kernels.mla_attention_kernel`` (absorbed MQA of ``BLOCK_H`` heads of one query token
over its causal prefix or its top-k list, optionally one key split), with the layouts chosen by
hand where Triton's choice wastes the tensor cores.

Why: in the Triton kernel the ``[64 heads, BLOCK_N keys]`` score tile feeds a second dot, and
Triton lays such a chain with all eight warps along the 64 rows, so both warpgroups compute the
same scores (about 1.5x the useful tensor work, plus spills). Here the two warpgroups split the
score tile by keys (``warps_per_cta=[4, 2]``) and the ``[64, LORA]`` accumulator by latent
columns, and exchange the softmax probabilities through shared memory:

- q (latent and rope parts) is copied once into shared memory, the A operand of the score MMA;
- each key tile's latent and rope rows are gathered by ``cp.async`` (one row address per key,
  from the top-k list's cache slots when sparse, from the page table when dense) into one of two
  buffers, so the next tile's copy runs under this tile's MMAs;
- scores ``[64, BLOCK_N] = q_lat . c^T + q_pe . k_pe^T`` (each warpgroup half of the keys),
  online softmax in base 2 with fp32 statistics (the row max crosses the two warpgroups),
  probabilities to shared memory, then ``acc += p . c`` (each warpgroup half of the latent).

Shared memory at DeepSeek's shapes (LORA 512, ROPE 64, 64 heads, 64 keys, bf16): q 72 KiB, two key
buffers 144 KiB, p 8 KiB, 224 KiB of the 227 an H100/H200 block may hold. Gluon has no CPU
interpreter: CI runs the Triton kernel and compiles this one for sm_90a
(``test_gluon_kernel_compiles_for_hopper``); the GPU tests compare it with the float64 oracle.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from weir.plugins.attention.mla_triton_kernels import program_key_tiles
from weir.plugins.attention.triton_paged_kernels import NEG_BIG

# cp.async into shared memory: ``async_load`` from triton 3.7 on (its old name raises there).
copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
block_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # the same rename

BLOCK_H = 64  # heads a program: one wgmma row block per warpgroup
BLOCK_N = 64  # keys a tile
NUM_WARPS = 8  # two warpgroups
HOPPER_BLOCK_SHARED_BYTES = 232448  # the most shared memory one H100/H200 block may opt into
# Left for what the compiler adds for the row reductions' and layout conversions' scratch (512
# bytes at DeepSeek's shapes): the kernel's own buffers (shared_bytes) may take the rest.
COMPILER_SCRATCH_BYTES = 2048
SHARED_BYTES = HOPPER_BLOCK_SHARED_BYTES - COMPILER_SCRATCH_BYTES


def shared_bytes(lora: int, rope: int, item_bytes: int = 2) -> int:
    """The kernel's own shared memory: q, two key tiles and the probabilities."""
    return item_bytes * (BLOCK_H * (lora + rope) + 2 * BLOCK_N * (lora + rope) + BLOCK_H * BLOCK_N)


@gluon.constexpr_function
def gather_layout(num_warps):
    """Rows copied 8 16-bit values (16 bytes) a thread, 64 columns a row per 8 threads, 4 rows a
    warp: the latent and the rope tiles share it, so one vector of row addresses serves both."""
    return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def mma_layout(cols):
    """Rows over one warpgroup's four warps, columns split between the two warpgroups."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, min(256, cols // 2), 16])


@gluon.constexpr_function
def operand_layout(shape, dtype):
    return gl.NVMMASharedLayout.get_default_for(shape, dtype)


@gluon.jit
def tile_slots(slot_list_ptr, table_row_ptr, tile, num_keys, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
               SPARSE: gl.constexpr, layout: gl.constexpr):
    """Cache slots ``[BLOCK_N]`` of key tile ``tile`` (-1: no key): the top-k list's entries
    (sparse) or the keys' pages from the page table (dense). Loaded a tile before their copy is
    issued, so the copy never waits on them."""
    entries = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout)
    in_range = entries < num_keys
    if SPARSE:
        slots = gl.load(slot_list_ptr + entries, mask=in_range, other=-1)
    else:
        pages = gl.load(table_row_ptr + entries // BLOCK_SIZE, mask=in_range, other=0)
        slots = gl.where(in_range, pages * BLOCK_SIZE + entries % BLOCK_SIZE, -1)
    return slots


@gluon.jit
def key_exists(slot_list_ptr, tile, num_keys, BLOCK_N: gl.constexpr, SPARSE: gl.constexpr, layout: gl.constexpr):
    """Which keys of tile ``tile`` exist, in the scores' column layout."""
    entries = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout)
    exists = entries < num_keys
    if SPARSE:
        exists = gl.load(slot_list_ptr + entries, mask=exists, other=-1) >= 0
    return exists


@gluon.jit
def copy_key_tile(cache_ptr, slots, stride_c_block, stride_c_offset, latent_buf, rope_buf, LORA: gl.constexpr,
                  ROPE: gl.constexpr, BLOCK_SIZE: gl.constexpr, layout: gl.constexpr):
    """Issue the cp.async copies of a tile's latent and rope rows (``slots`` in the rows' slice of
    ``layout``); slots < 0 read zeros."""
    exists = slots >= 0
    slots = gl.maximum(slots, 0)
    rows = (slots // BLOCK_SIZE).to(gl.int64) * stride_c_block + (slots % BLOCK_SIZE) * stride_c_offset
    cols = gl.arange(0, LORA, gl.SliceLayout(0, layout))
    copy_to_shared(latent_buf, cache_ptr + rows[:, None] + cols[None, :], mask=exists[:, None])
    cols = LORA + gl.arange(0, ROPE, gl.SliceLayout(0, layout))
    copy_to_shared(rope_buf, cache_ptr + rows[:, None] + cols[None, :], mask=exists[:, None])


# Batch sizes vary every step: no value specialisation, so no compile in the middle of a run.
@gluon.jit(do_not_specialize=["num_reqs", "num_tokens", "num_splits", "stride_bt", "topk"])
def mla_attention_wgmma_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, o_lat_ptr, partial_out_ptr, partial_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, topk_ptr,
    num_reqs, num_tokens, num_splits, topk, qk_scale,
    stride_qlh, stride_qlt, stride_qpt, stride_qph, stride_olh, stride_olt, stride_bt,
    stride_c_block, stride_c_offset, stride_kt,
    stride_pt, stride_ph, stride_ps,  # partial_out [T, H, S, LORA]; partial_lse [T, H, S] shares them / LORA
    NUM_HEADS: gl.constexpr, LORA: gl.constexpr, ROPE: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    SPARSE: gl.constexpr, SPLIT: gl.constexpr, BLOCK_H: gl.constexpr = BLOCK_H, BLOCK_N: gl.constexpr = BLOCK_N,
):
    """``mla_attention_kernel``'s contract (its docstring) with ``BLOCK_H`` 64 and 8 warps."""
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = cache_ptr.dtype.element_ty
    token, head_block, split, req, num_keys, first_tile, end_tile = program_key_tiles(
        query_start_loc_ptr, seq_lens_ptr, num_reqs, num_tokens, num_splits, topk, NUM_HEADS, BLOCK_H, BLOCK_N, SPARSE)
    token64 = token.to(gl.int64)
    slot_list = topk_ptr + token64 * stride_kt  # sparse: this token's top-k cache slots
    table_row = block_tables_ptr + req.to(gl.int64) * stride_bt

    s_layout: gl.constexpr = mma_layout(BLOCK_N)  # scores [BLOCK_H, BLOCK_N]
    o_layout: gl.constexpr = mma_layout(LORA)  # accumulator [BLOCK_H, LORA]
    q_lat_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LORA], operand_layout([BLOCK_H, LORA], dtype))
    q_pe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], operand_layout([BLOCK_H, ROPE], dtype))
    latent_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LORA], operand_layout([BLOCK_N, LORA], dtype))
    rope_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], operand_layout([BLOCK_N, ROPE], dtype))
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], operand_layout([BLOCK_H, BLOCK_N], dtype))

    # q rows of heads past NUM_HEADS read zeros; their outputs are not stored.
    gather: gl.constexpr = gather_layout(num_warps)
    heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, gather))
    head_valid = (heads < NUM_HEADS)[:, None]
    cols = gl.arange(0, LORA, gl.SliceLayout(0, gather))
    copy_to_shared(q_lat_smem, q_lat_ptr + heads[:, None].to(gl.int64) * stride_qlh + token64 * stride_qlt
                   + cols[None, :], mask=head_valid)
    cols = gl.arange(0, ROPE, gl.SliceLayout(0, gather))
    copy_to_shared(q_pe_smem, q_pe_ptr + token64 * stride_qpt + heads[:, None] * stride_qph + cols[None, :],
                   mask=head_valid)
    # Two stages ahead of the MMAs: a tile's slots load one iteration before its rows' copy is
    # issued, and that copy one iteration before the MMAs read it. No key past end_tile is read.
    rows_layout: gl.constexpr = gl.SliceLayout(1, gather)
    slots = tile_slots(slot_list, table_row, first_tile, num_keys, BLOCK_N, BLOCK_SIZE, SPARSE, rows_layout)
    copy_key_tile(cache_ptr, slots, stride_c_block, stride_c_offset, latent_bufs.index(0), rope_bufs.index(0),
                  LORA, ROPE, BLOCK_SIZE, gather)
    async_copy.commit_group()
    slots = tile_slots(slot_list, table_row, first_tile + 1, gl.where(first_tile + 1 < end_tile, num_keys, 0),
                       BLOCK_N, BLOCK_SIZE, SPARSE, rows_layout)

    m_i = gl.full([BLOCK_H], NEG_BIG, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_H, LORA], gl.float32, o_layout)
    for kv_tile in range(first_tile, end_tile):
        buf = (kv_tile - first_tile) % 2
        # The next tile's buffer was last read before the previous iteration's closing barrier.
        copy_key_tile(cache_ptr, slots, stride_c_block, stride_c_offset, latent_bufs.index(1 - buf),
                      rope_bufs.index(1 - buf), LORA, ROPE, BLOCK_SIZE, gather)
        async_copy.commit_group()
        slots = tile_slots(slot_list, table_row, kv_tile + 2, gl.where(kv_tile + 2 < end_tile, num_keys, 0),
                           BLOCK_N, BLOCK_SIZE, SPARSE, rows_layout)
        exists = key_exists(slot_list, kv_tile, num_keys, BLOCK_N, SPARSE, gl.SliceLayout(0, s_layout))
        async_copy.wait_group(1)  # this thread's copies of this tile have landed
        fence_async_shared()  # ... and are visible to the MMAs (async proxy)
        block_barrier()  # ... as are every other thread's
        latent = latent_bufs.index(buf)  # [BLOCK_N, LORA]
        rope = rope_bufs.index(buf)  # [BLOCK_N, ROPE]

        scores = warpgroup_mma(q_lat_smem, latent.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout),
                               use_acc=False, is_async=True)
        scores = warpgroup_mma(q_pe_smem, rope.permute((1, 0)), scores, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))  # [BLOCK_H, BLOCK_N]
        scores = gl.where(exists[None, :], scores * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
        alpha = gl.exp2(m_i - m_new)  # [BLOCK_H]
        p = gl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_smem.store(p.to(dtype))
        fence_async_shared()
        block_barrier()  # both warpgroups' halves of p are in place

        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_smem, latent, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # [BLOCK_H, LORA]
        block_barrier()  # nobody reads this tile's buffers or p any more
    async_copy.wait_group(0)

    # A split (or a padding request) with no keys leaves l_i = 0: output 0, weight exp2(NEG_BIG).
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, LORA, gl.SliceLayout(0, o_layout))
    if SPLIT:
        partial = token64 * stride_pt + heads * stride_ph + split * stride_ps  # [BLOCK_H]
        gl.store(partial_out_ptr + partial[:, None] + cols[None, :], out, mask=(heads < NUM_HEADS)[:, None])
        lse = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), NEG_BIG)  # [BLOCK_H] in the scores' row layout
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, s_layout))
        partial = token64 * stride_pt + heads * stride_ph + split * stride_ps
        gl.store(partial_lse_ptr + partial // LORA, lse, mask=heads < NUM_HEADS)
    else:
        gl.store(o_lat_ptr + heads[:, None].to(gl.int64) * stride_olh + token64 * stride_olt + cols[None, :],
                 out.to(o_lat_ptr.dtype.element_ty), mask=(heads < NUM_HEADS)[:, None])
