"""Per-op timing of step-input preparation: torch versions against the Triton kernels (CUDA).

    python3 -m benchmarks.kernel_bench.bench_input_prep [--iters 200]

Two batches: a B=256 decode batch and a mixed 8192-token batch (64 decodes plus 8 prefill
chunks of 1016 tokens). Each op is timed two ways, in microseconds per call:
  eager: a loop of calls between CUDA events (launch overhead included; what an eager step pays),
  graph: the same calls captured in one CUDA graph and replayed (device time only).
The request table is sized like Qwen3-0.6B serving: 1024 rows, max_model_len 4096, block size
16, KV store of 8 KV heads x 128 in bf16 from a fused QKV projection (16 query heads).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_bench.timing import graph_us, loop_us
from weir.buffers import staged_write
from weir.kernels import kv_store, triton_input_prep as tk, triton_kv_store
from weir.runner import inputs

NUM_ROWS, MAX_MODEL_LEN, BLOCK_SIZE, VOCAB = 1024, 4096, 16, 151_936
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128


def make_batch(query_lens: list[int], device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    num_reqs = len(query_lens)
    rows = torch.randperm(NUM_ROWS, generator=gen)[:num_reqs]
    num_computed = torch.randint(100, 2000, (NUM_ROWS,), generator=gen, dtype=torch.int32)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    num_tokens = int(query_start_loc[-1])
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    num_cache_blocks = NUM_ROWS * 8
    batch = dict(
        token_ids=torch.randint(0, VOCAB, (NUM_ROWS, MAX_MODEL_LEN), generator=gen, dtype=torch.int32),
        num_computed=num_computed,
        num_known=num_computed + torch.tensor(max(query_lens)),
        counts=torch.zeros(NUM_ROWS, VOCAB, dtype=torch.int32),
        block_table=torch.randint(1, num_cache_blocks, (NUM_ROWS, max_blocks), generator=gen, dtype=torch.int32),
        idx_mapping=rows,
        query_start_loc=query_start_loc,
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        sampled=torch.randint(0, VOCAB, (num_reqs,), generator=gen),
        kv_cache=torch.zeros(2, num_cache_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16),
        qkv=torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).bfloat16(),
        # A staged write as a new prefill request makes it: one table row of token ids.
        flat_index=torch.arange(num_tokens, dtype=torch.int64) + 5 * MAX_MODEL_LEN,
        values=torch.randint(0, VOCAB, (num_tokens,), generator=gen, dtype=torch.int32),
    )
    batch = {name: t.to(device) for name, t in batch.items()}
    _, batch["positions"], _ = inputs.prepare_step_inputs_torch(
        batch["token_ids"], num_computed.to(device), rows.to(device), query_start_loc.to(device), num_tokens)
    batch["block_tables"] = inputs.gather_block_tables_torch(batch["block_table"], batch["idx_mapping"])
    slots = inputs.compute_slot_mapping_torch(batch["block_tables"], batch["query_start_loc"],
                                              batch["positions"], BLOCK_SIZE)
    batch["slot_mapping"], batch["num_tokens"] = slots, num_tokens
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    batch["k"] = batch["qkv"][:, q_size: q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    batch["v"] = batch["qkv"][:, q_size + kv_size:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return batch


def op_calls(b: dict) -> dict[str, tuple]:
    """Op name -> (torch call, triton call), each a zero-argument function over batch ``b``."""
    T, bs = b["num_tokens"], BLOCK_SIZE
    prep = (b["token_ids"], b["num_computed"], b["idx_mapping"], b["query_start_loc"], T)
    slots = (b["block_tables"], b["query_start_loc"], b["positions"], bs)
    fused = (b["block_table"].unsqueeze(0), b["idx_mapping"], b["query_start_loc"], b["positions"], bs)  # one group
    post = (b["token_ids"], b["num_known"], b["num_computed"], b["counts"], b["idx_mapping"], b["query_lens"],
            b["sampled"])
    store = (b["kv_cache"], b["k"], b["v"], b["slot_mapping"])
    scatter = (b["token_ids"], b["flat_index"], b["values"])
    return {
        "prepare_step_inputs": (lambda: inputs.prepare_step_inputs_torch(*prep),
                                lambda: tk.prepare_step_inputs_triton(*prep)),
        "gather_block_tables": (lambda: inputs.gather_block_tables_torch(b["block_table"], b["idx_mapping"]),
                                lambda: tk.gather_block_tables_triton(b["block_table"], b["idx_mapping"])),
        "compute_slot_mapping": (lambda: inputs.compute_slot_mapping_torch(*slots),
                                 lambda: tk.compute_slot_mapping_triton(*slots)),
        "gather+slot_mapping (fused)": (lambda: inputs.gather_block_tables_and_slot_mapping_torch(*fused),
                                        lambda: tk.gather_block_tables_and_slot_mapping_triton(*fused)),
        "post_update (with counts)": (lambda: inputs.post_update_torch(*post),
                                      lambda: tk.post_update_triton(*post)),
        "post_update (no counts)": (lambda: inputs.post_update_torch(*post[:3], None, *post[4:]),
                                    lambda: tk.post_update_triton(*post[:3], None, *post[4:])),
        "scatter_flat (one row)": (lambda: staged_write.scatter_flat_torch(*scatter),
                                   lambda: tk.scatter_flat_triton(*scatter)),
        "store_kv (one layer)": (lambda: kv_store.store_kv_torch(*store),
                                 lambda: triton_kv_store.store_kv_triton(*store)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_input_prep needs a CUDA device")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, iters {args.iters}")
    batches = {"decode B=256": [1] * 256, "mixed 8192 tokens (64 decode + 8x1016 prefill)": [1] * 64 + [1016] * 8}
    for title, query_lens in batches.items():
        batch = make_batch(query_lens, device)
        print(f"\n{title}: {batch['num_tokens']} tokens, {len(query_lens)} requests")
        print(f"{'op':30} {'torch eager':>12} {'triton eager':>13} {'torch graph':>12} {'triton graph':>13}")
        for name, (torch_call, triton_call) in op_calls(batch).items():
            cells = [f"{loop_us(torch_call, args.iters):12.1f}", f"{loop_us(triton_call, args.iters):13.1f}"]
            for call in (torch_call, triton_call):
                try:
                    cells.append(f"{graph_us(call, repeats=args.iters, iters=3):12.1f}")
                except RuntimeError as error:  # an op that cannot be captured: say so, keep going
                    cells.append(f"{'n/a':>12}")
                    print(f"  ({name}: graph capture failed: {str(error).splitlines()[0]})")
            print(f"{name:30} " + " ".join(cells) + "   us/call")


if __name__ == "__main__":
    main()
