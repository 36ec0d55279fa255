"""Microseconds per call of the Triton MLA / DSA backend (``triton_mla``), with torch beside it.

The attention kernel is the backend's choice on this GPU (the Gluon wgmma kernel on Hopper);
``--kernels wgmma,triton`` times each of them in turn, rows labelled by kernel.

DeepSeek-V3 / V3.2 attention shapes (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128; the
indexer 64 heads x 128, top-k 2048), bf16, one layer, on a CUDA device:

- dense decode at batch 1 / 32 / 256 and contexts 1k-16k, against torch's absorbed form over
  the same paged cache (block-table gather, einsum scores, softmax, einsum values);
- sparse (DSA) decode at the same points past 2048 keys, against torch (gathered indexer
  scores, torch.topk, attention over the gathered top-k rows);
- prefill: the backend's absorbed prefill against torch's expanded form (per-head K/V from the
  latent, SDPA flash), the alternative for prefill tokens.

Decode times are CUDA-graph replays (as the runner launches decode), prefill times single
calls; each Triton time includes the cache store and both W_UK / W_UV batched GEMMs. GB/s counts
the latent rows read once per request (1152 B each); TFLOP/s the absorbed form's dot products.

    python3 -m benchmarks.kernel_bench.bench_mla [--sweep] [--quick] [--block-size 64] [--kernels wgmma,triton]
    python3 -m benchmarks.kernel_bench.bench_mla --prefill-sweep   # attention tiles for prefill steps alone
    python3 -m benchmarks.kernel_bench.bench_mla --indexer-sweep   # the indexer's score kernels and top-k alone
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.kernel_bench.timing import graph_us, median_us
from weir.attention import AttentionMetadata
from weir.mla import IndexerInputs, MLALayerSpec
from weir.plugins.attention.mla_triton import (BLOCK_SCORES_MIN_QUERY_LEN, TOPK_BLOCK, TOPK_RESIDENT_WARPS, MLATiles,
                                              ScoreTiles, TritonMLABackend)

HEADS, LORA, ROPE, NOPE, V = 128, 512, 64, 128, 128
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
DTYPE = torch.bfloat16


def layer_spec(sparse: bool) -> MLALayerSpec:
    indexer = dict(index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=TOPK) if sparse else {}
    return MLALayerSpec(layer_idx=0, num_heads=HEADS, kv_lora_rank=LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                        v_head_dim=V, scale=(NOPE + ROPE) ** -0.5, **indexer)


def make_step(layer: MLALayerSpec, query_lens: list[int], seq_lens: list[int], block_size: int):
    """Random inputs, a random cache and shuffled block tables (the setup may sync; timing does not)."""
    blocks_per_req = triton.cdiv(max(seq_lens), block_size)
    num_blocks = len(seq_lens) * blocks_per_req + 1
    block_tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).int().view(len(seq_lens), -1)
    req_of_token = torch.tensor([r for r, ql in enumerate(query_lens) for _ in range(ql)], device="cuda")
    positions = torch.tensor([p for ql, s in zip(query_lens, seq_lens) for p in range(s - ql, s)], device="cuda")
    slots = block_tables.long()[req_of_token, positions // block_size] * block_size + positions % block_size
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device="cuda")
    num_tokens = sum(query_lens)
    metadata = AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_tables, slots,
                                 len(seq_lens), num_tokens, max(query_lens), max(seq_lens))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(DTYPE)

    inputs = dict(q_nope=rand(num_tokens, HEADS, NOPE), q_pe=rand(num_tokens, HEADS, ROPE), kv_c=rand(num_tokens, LORA),
                  k_pe=rand(num_tokens, ROPE), kv_cache=rand(num_blocks, block_size, layer.cache_dim),
                  metadata=metadata, w_uk=rand(HEADS, NOPE, LORA, scale=LORA ** -0.5),
                  w_uv=rand(HEADS, V, LORA, scale=LORA ** -0.5))
    if layer.index_topk:
        inputs["indexer"] = IndexerInputs(rand(num_tokens, INDEX_HEADS, INDEX_DIM), rand(num_tokens, INDEX_DIM),
                                          torch.randn(num_tokens, INDEX_HEADS, device="cuda") * INDEX_HEADS ** -0.5)
    return inputs


def gathered_cache(inputs, max_seq_len: int) -> torch.Tensor:  # [B, max_seq_len, cache_dim]
    cache, tables = inputs["kv_cache"], inputs["metadata"].block_tables
    return cache[tables].flatten(1, 2)[:, :max_seq_len]


def torch_decode(layer: MLALayerSpec, inputs) -> torch.Tensor:
    """Absorbed MLA decode in torch ops over the gathered paged cache (dense, or DSA over torch.topk)."""
    metadata = inputs["metadata"]
    kv = gathered_cache(inputs, metadata.max_seq_len)  # [B, S, cache_dim]
    visible = torch.arange(metadata.max_seq_len, device="cuda")[None, :] < metadata.seq_lens[:, None]  # [B, S]
    if layer.index_topk:
        indexer = inputs["indexer"]
        logits = torch.einsum("bgd,bsd->bgs", indexer.q, kv[..., layer.latent_dim:]).float().relu_()
        scores = torch.einsum("bgs,bg->bs", logits, indexer.weights).masked_fill(~visible, float("-inf"))
        picked = scores.topk(min(TOPK, metadata.max_seq_len), dim=-1).indices  # [B, K]
        kv = kv.gather(1, picked.unsqueeze(-1).expand(-1, -1, kv.shape[-1]))
        visible = visible.gather(1, picked)
    q_lat = torch.bmm(inputs["q_nope"].transpose(0, 1), inputs["w_uk"]).transpose(0, 1)  # [B, H, L]
    scores = (torch.einsum("bhl,bsl->bhs", q_lat, kv[..., :LORA])
              + torch.einsum("bhr,bsr->bhs", inputs["q_pe"], kv[..., LORA:layer.latent_dim])).float() * layer.scale
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1).to(DTYPE)
    o_lat = torch.einsum("bhs,bsl->bhl", probs, kv[..., :LORA])
    return torch.bmm(o_lat.transpose(0, 1), inputs["w_uv"].transpose(1, 2)).transpose(0, 1)


def torch_expanded_prefill(inputs, query_len: int, seq_len: int):
    """The expanded alternative for one request's prefill chunk: per-head K/V of all its keys
    from the gathered latent (two GEMMs), then SDPA flash (causal over the chunk's last rows)."""
    kv = gathered_cache(inputs, seq_len)[0]  # [S, cache_dim]
    latent, k_pe = kv[:, :LORA], kv[:, LORA:LORA + ROPE]
    k_nope = (latent @ inputs["w_uk"].reshape(HEADS * NOPE, LORA).T).view(seq_len, HEADS, NOPE)
    values = (latent @ inputs["w_uv"].reshape(HEADS * V, LORA).T).view(seq_len, HEADS, V)
    keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, HEADS, -1)], dim=-1)  # [S, H, 192]
    queries = torch.cat([inputs["q_nope"], inputs["q_pe"]], dim=-1)  # [Q, H, 192]
    query_positions = torch.arange(seq_len - query_len, seq_len, device="cuda")[:, None]
    mask = None if query_len == seq_len else torch.arange(seq_len, device="cuda")[None, :] <= query_positions
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(
            queries.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=(NOPE + ROPE) ** -0.5)


def absorbed_flops(query_lens, seq_lens, sparse: bool) -> float:
    pairs = 0
    for query_len, seq_len in zip(query_lens, seq_lens):
        for position in range(seq_len - query_len, seq_len):
            pairs += min(position + 1, TOPK) if sparse else position + 1
    return pairs * HEADS * 2 * (LORA + ROPE + LORA)


def decode_row(backend, sparse: bool, batch: int, context: int, block_size: int, with_torch: bool) -> str:
    layer = layer_spec(sparse)
    inputs = make_step(layer, [1] * batch, [context] * batch, block_size)
    forward = lambda: backend.forward(layer, **inputs)
    triton_us = graph_us(forward)
    plan = backend.plan(layer, batch, 1, context)
    keys = min(context, TOPK) if plan.sparse else context
    line = (f"{'sparse' if sparse else 'dense':6s} decode B={batch:<3d} ctx={context:<6d} "
            f"{backend.attention_kernel:6s} {triton_us:9.1f} us "
            f"{batch * keys * 1152 / triton_us / 1e3:6.0f} GB/s "
            f"{absorbed_flops([1] * batch, [context] * batch, plan.sparse) / triton_us / 1e6:6.1f} TFLOP/s "
            f"splits={plan.num_splits}")
    if with_torch:
        try:
            torch_us = graph_us(lambda: torch_decode(layer, inputs))
            line += f"  | torch {torch_us:9.1f} us  x{torch_us / triton_us:5.1f}"
        except torch.OutOfMemoryError:
            line += "  | torch: out of memory"
        torch.cuda.empty_cache()
    return line


def prefill_row(backend, sparse: bool, query_len: int, seq_len: int, block_size: int, with_torch: bool = True) -> str:
    layer = layer_spec(sparse)
    inputs = make_step(layer, [query_len], [seq_len], block_size)
    triton_us = median_us(lambda: backend.forward(layer, **inputs), iters=10)
    flops = absorbed_flops([query_len], [seq_len], sparse and seq_len > TOPK)
    line = (f"{'sparse' if sparse else 'dense':6s} prefill {query_len:5d} tokens at {seq_len:6d} keys: "
            f"{backend.attention_kernel} absorbed "
            f"{triton_us:9.1f} us {flops / triton_us / 1e6:6.1f} TFLOP/s")
    if with_torch and not sparse:
        expanded_us = median_us(lambda: torch_expanded_prefill(inputs, query_len, seq_len), iters=10)
        line += f"  | torch expanded (GEMMs + SDPA) {expanded_us:9.1f} us"
    return line


def compiled_variants(kernel) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def compiled_stats(kernel) -> str:
    """Registers, spills, shared memory and matrix instructions of the variant compiled last (wgmma:
    Hopper's)."""
    compiled = [entry for caches in kernel.device_caches.values() for entry in caches[0].values()]
    if not compiled:
        return ""
    last = compiled[-1]
    ptx = last.asm.get("ptx", "")
    matrix = "wgmma" if "wgmma" in ptx else ("mma" if "mma.sync" in ptx else "no-mma")
    shared = getattr(last.metadata, "shared", 0)
    return f"regs={last.n_regs} spills={last.n_spills} smem={shared // 1024}KiB {matrix}"


def row_with_stats(kernel, timed_row) -> tuple[str, str]:
    """``timed_row()``'s line, and the stats of the variant it compiled (none if it compiled none:
    the stats are the last compiled variant's)."""
    variants = compiled_variants(kernel)
    row = timed_row()
    return row, compiled_stats(kernel) if compiled_variants(kernel) > variants else ""


def stage_times(backend, sparse: bool, batch: int, context: int, block_size: int) -> str:
    """Graph-replay microseconds of each launch of one decode forward."""
    layer = layer_spec(sparse)
    inputs = make_step(layer, [1] * batch, [context] * batch, block_size)
    metadata, cache = inputs["metadata"], inputs["kv_cache"]
    plan = backend.plan(layer, batch, 1, context)
    q_lat = torch.bmm(inputs["q_nope"].transpose(0, 1), inputs["w_uk"])
    o_lat = torch.empty_like(q_lat)
    topk = backend.topk_slots(layer, inputs.get("indexer"), cache, metadata) if plan.sparse else None
    stages = {
        "store": lambda: backend.store(layer, inputs["kv_c"], inputs["k_pe"], inputs.get("indexer"), cache,
                                       metadata.slot_mapping),
        "w_uk bmm": lambda: torch.bmm(inputs["q_nope"].transpose(0, 1), inputs["w_uk"]),
        "attend": lambda: backend.attend(layer, q_lat, inputs["q_pe"], cache, metadata, o_lat, plan, topk),
        "w_uv bmm": lambda: torch.bmm(o_lat, inputs["w_uv"].transpose(1, 2)).transpose(0, 1),
    }
    if plan.sparse:
        scores = torch.empty((batch, context), dtype=torch.float32, device="cuda")
        stages["indexer scores"] = lambda: backend.indexer_scores(layer, inputs["indexer"], cache, metadata, scores,
                                                                  0, batch)
        stages["top-k"] = lambda: backend.select_topk(layer, scores, topk, metadata, 0, batch)
    times = "  ".join(f"{name} {graph_us(fn):7.1f}" for name, fn in stages.items())
    return f"  stages {'sparse' if sparse else 'dense'} B={batch} ctx={context}: {times} us"


def sweep(backend, block_size: int, topk: bool = True) -> None:
    """Top-k kernel variants (``topk``), then the attention tiles of DECODE_TILES."""
    from weir.plugins.attention.mla_triton_kernels import mla_attention_kernel

    for batch, context in ((1, 16384), (32, 8192), (32, 16384), (256, 16384)) if topk else ():
        for block, counting, warps in ((8192, False, 8), (16384, False, 16), (16384, True, 16), (16384, True, 8)):
            backend.topk_block, backend.topk_counting, backend.topk_warps = block, counting, warps
            label = f"top-k block={block} {'counting' if counting else 'radix'} warps={warps}"
            print(label, stage_times(backend, True, batch, context, block_size), flush=True)
    backend.topk_block, backend.topk_counting, backend.topk_warps = TOPK_BLOCK, True, TOPK_RESIDENT_WARPS
    for sparse, batch, context in ((False, 256, 1024), (False, 256, 4096), (True, 256, 16384)):
        for tiles in DECODE_TILES:
            backend.attention_tiles = tiles
            label = tiles_label(tiles)
            try:  # some configs need more shared memory or registers than the SM has
                print(label, *row_with_stats(mla_attention_kernel, lambda: decode_row(
                    backend, sparse, batch, context, block_size, False)), flush=True)
            except Exception as error:  # noqa: BLE001 - a failed config is a result of the sweep
                print(f"{label}: failed ({type(error).__name__}: {str(error)[:80]})", flush=True)
            torch.cuda.empty_cache()
        backend.attention_tiles = None


def tiles_label(tiles: MLATiles) -> str:
    return f"    tiles h={tiles.block_h} n={tiles.block_n} warps={tiles.num_warps} stages={tiles.num_stages}"


# Attention tiles tried for decode, the default first.
DECODE_TILES = (MLATiles(64, 64, 8, 3), MLATiles(64, 32, 8, 3), MLATiles(64, 64, 8, 2))
# Tried for prefill: the same, wider key tiles, then all 128 heads in one program (each gathered
# key tile loaded once for every head, not once per 64; on an H200 those fail to compile).
PREFILL_TILES = DECODE_TILES + (MLATiles(64, 128, 8, 2), MLATiles(128, 64, 16, 2), MLATiles(128, 32, 16, 3),
                                MLATiles(128, 64, 8, 2))


def prefill_sweep(backend, block_size: int) -> None:
    """Prefill rows (sparse past the top-k, dense below it) under each of PREFILL_TILES."""
    from weir.plugins.attention.mla_triton_kernels import mla_attention_kernel

    for sparse, query_len, seq_len in ((True, 2048, 16384), (True, 8192, 8192), (False, 2048, 2048)):
        for tiles in PREFILL_TILES:
            backend.attention_tiles = tiles
            label = tiles_label(tiles)
            try:  # some configs need more shared memory or registers than the SM has
                print(label, *row_with_stats(mla_attention_kernel, lambda: prefill_row(
                    backend, sparse, query_len, seq_len, block_size)), flush=True)
            except Exception as error:  # noqa: BLE001 - a failed config is a result of the sweep
                print(f"{label}: failed ({type(error).__name__}: {str(error)[:80]})", flush=True)
            torch.cuda.empty_cache()
    backend.attention_tiles = None


# Block-of-tokens indexer tiles tried on prefill steps, the default first; the one-token kernel
# is timed beside them.
SCORE_TILES = (ScoreTiles(2, 128, 4, 3), ScoreTiles(2, 128, 8, 3), ScoreTiles(4, 128, 8, 3), ScoreTiles(4, 128, 8, 2),
               ScoreTiles(4, 64, 4, 3), ScoreTiles(4, 64, 8, 3))


def indexer_sweep(backend, block_size: int) -> None:
    """The indexer's scores and top-k, alone, on prefill steps (one score-buffer pass of rows at
    the end of the prompt, where rows are longest): each score kernel and tile set, then each
    top-k search; and on decode at B=32, the top-k at the step's own longest sequence and at the
    bound a CUDA graph bakes (the long-context workload's max_model_len, past the top-k's
    register block)."""
    layer = layer_spec(True)
    for query_len, seq_len in ((2048, 16384), (4096, 16000)):
        inputs = make_step(layer, [query_len], [seq_len], block_size)
        metadata, cache = inputs["metadata"], inputs["kv_cache"]
        scores = torch.empty((query_len, seq_len), dtype=torch.float32, device="cuda")
        topk = torch.empty((query_len, TOPK), dtype=torch.int32, device="cuda")
        flops = 2 * INDEX_HEADS * INDEX_DIM * sum(seq_len - query_len + t + 1 for t in range(query_len))
        label = f"prefill {query_len} tokens at {seq_len} keys"
        for tiles in (None,) + SCORE_TILES:
            backend.block_scores_min_query_len = 1 << 30 if tiles is None else 2
            backend.block_score_tiles = tiles
            us = median_us(lambda: backend.indexer_scores(layer, inputs["indexer"], cache, metadata, scores, 0,
                                                          query_len), iters=10)
            print(f"  {label}: scores {'one token a program' if tiles is None else tiles} {us:9.1f} us "
                  f"{flops / us / 1e6:6.1f} TFLOP/s", flush=True)
        for counting in (True, False):
            backend.topk_counting = counting
            us = median_us(lambda: backend.select_topk(layer, scores, topk, metadata, 0, query_len), iters=10)
            print(f"  {label}: top-k {'counting' if counting else 'radix'} {us:9.1f} us", flush=True)
        backend.topk_counting = True
        torch.cuda.empty_cache()
    backend.block_scores_min_query_len, backend.block_score_tiles = BLOCK_SCORES_MIN_QUERY_LEN, None
    batch, context, graph_len = 32, 12288, 16640
    inputs = make_step(layer, [1] * batch, [context] * batch, block_size)
    metadata, cache = inputs["metadata"], inputs["kv_cache"]
    topk = torch.empty((batch, TOPK), dtype=torch.int32, device="cuda")
    for max_seq_len in (context, graph_len):  # every row in the top-k's register block; each row picks its path
        step = replace(metadata, max_seq_len=max_seq_len)
        scores = torch.empty((batch, max_seq_len), dtype=torch.float32, device="cuda")
        times = {"scores": graph_us(lambda: backend.indexer_scores(layer, inputs["indexer"], cache, step, scores,
                                                                  0, batch)),
                 "top-k": graph_us(lambda: backend.select_topk(layer, scores, topk, step, 0, batch))}
        print(f"  decode B={batch} at {context} keys, max_seq_len {max_seq_len}: "
              + "  ".join(f"{name} {us:7.1f} us" for name, us in times.items()), flush=True)


def table(backend, block_size: int, quick: bool, with_torch: bool) -> None:
    """Decode (dense, sparse) and prefill rows of the backend's attention kernel."""
    contexts = (1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384)
    for batch, context in itertools.product((1, 32, 256), contexts):
        print(decode_row(backend, False, batch, context, block_size, with_torch and not (quick and batch == 256)),
              flush=True)
    for batch, context in itertools.product((1, 32, 256), (4096, 16384)):
        print(decode_row(backend, True, batch, context, block_size, with_torch and not (quick and batch == 256)),
              flush=True)
    for query_len, seq_len in ((1024, 1024), (4096, 4096), (512, 16384), (2048, 16384)):
        print(prefill_row(backend, False, query_len, seq_len, block_size, with_torch), flush=True)
    for query_len, seq_len in ((2048, 16384), (8192, 8192)):
        print(prefill_row(backend, True, query_len, seq_len, block_size, with_torch), flush=True)
    print(f"  {backend.attention_kernel} kernel, last variant compiled: {compiled_stats(attention_kernel(backend))}",
          flush=True)


def attention_kernel(backend):
    from weir.plugins.attention import mla_triton

    if backend.attention_kernel == "wgmma":
        return mla_triton.wgmma_kernels.mla_attention_wgmma_kernel
    return mla_triton.mla_attention_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other attention tile configs")
    parser.add_argument("--quick", action="store_true", help="fewer decode points, no torch at batch 256")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--only-sweep", action="store_true", help="the sweep alone")
    parser.add_argument("--no-topk-sweep", action="store_true", help="sweep the attention tiles only")
    parser.add_argument("--prefill-sweep", action="store_true", help="only sweep the attention tiles of prefill steps")
    parser.add_argument("--kernels", default="", help="attention kernels to time in turn (wgmma, triton); "
                        "default: the backend's choice")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch rows beside decode and prefill")
    parser.add_argument("--indexer-sweep", action="store_true", help="only time the indexer's score kernels and top-k")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}  torch {torch.__version__}  "
          f"block_size {args.block_size}  (H={HEADS}, latent {LORA}+{ROPE}, bf16)", flush=True)
    backend = TritonMLABackend(args.block_size, DTYPE, torch.device("cuda"))
    if args.only_sweep:
        backend.attention_kernel = "triton"  # the sweeps time the Triton kernel's tiles
        sweep(backend, args.block_size, topk=not args.no_topk_sweep)
        return
    if args.indexer_sweep:
        indexer_sweep(backend, args.block_size)
        return
    if args.prefill_sweep:
        backend.attention_kernel = "triton"
        prefill_sweep(backend, args.block_size)
        return
    for kernel in args.kernels.split(",") if args.kernels else [backend.attention_kernel]:
        backend.attention_kernel = kernel
        table(backend, args.block_size, args.quick, with_torch=not args.no_torch)
    if args.sweep:
        backend.attention_kernel = "triton"
        sweep(backend, args.block_size)


if __name__ == "__main__":
    main()
