"""The memory-bandwidth floor of a hybrid MoE model's nano-bench: how fast any engine could run it.

    python3 -m benchmarks.roofline_next [benchmarks/models/qwen3-next-24l] [--bandwidth 4.3e12] [--peer 5662]
    python3 -m benchmarks.roofline_next benchmarks/models/kimi-linear-48b --peer 3917

Qwen3-Next (Gated DeltaNet + full attention) and Kimi Linear (Kimi Delta Attention + MLA, whose
cache is one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer).

Per decode batch-size bucket it also prints the floor's mean ms per step, to set beside the
buckets of ``benchmarks/profile_steps.py`` (where a real run loses its time).

A decode step must read every weight it uses once: the non-expert weights (all but the
embedding, of which it gathers a few rows), every expert some token of the batch routed to, each
running request's recurrent state (read and written back; conv states are left out, under 1%
of it) and its KV cache. Routing is taken as
uniform (random weights route close to that): a batch of ``b`` tokens touches
``E * (1 - (1 - k/E)^b)`` of the ``E`` experts on average. Prefill is charged its matmul FLOPs at
``--tflops``. Requests are assumed to all decode from the first step (no prefill in between),
which only lowers the floor. No kernel reaches the device's copy bandwidth on every byte, so a
real engine sits above these times; the ratio measured / floor says how close it gets.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
import transformers

from benchmarks.profile_steps import BUCKETS
from weir.cli.bench.throughput import random_workload

GiB = 2**30


def weight_bytes(model_dir: Path) -> tuple[int, int, int]:
    """(expert, embedding, other) weight bytes in bf16, counted on a meta-device transformers model."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expert = embedding = other = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * 2
        if ".experts." in name:
            expert += size
        elif "embed_tokens" in name:
            embedding += size
        else:
            other += size
    return expert, embedding, other


def cache_sizes(config: dict) -> tuple[int, int]:
    """(recurrent-state elements per request, KV-cache bytes per token in bf16) of all layers."""
    if config["model_type"] == "kimi_linear":
        linear = config["linear_attn_config"]
        state = len(linear["kda_layers"]) * linear["num_heads"] * linear["head_dim"] ** 2
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return state, len(linear["full_attn_layers"]) * latent * 2
    layer_types = config.get("layer_types") or [
        "full_attention" if (index + 1) % config["full_attention_interval"] == 0 else "linear_attention"
        for index in range(config["num_hidden_layers"])]
    state = (layer_types.count("linear_attention") * config["linear_num_value_heads"]
             * config["linear_key_head_dim"] * config["linear_value_head_dim"])
    kv = layer_types.count("full_attention") * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    return state, kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="benchmarks/models/qwen3-next-24l")
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s a kernel can stream")
    parser.add_argument("--tflops", type=float, default=700.0, help="bf16 matmul TFLOP/s charged to prefill")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--peer", type=float, default=None, help="a peer's output tok/s, for the ceiling ratio")
    args = parser.parse_args()
    model_dir = Path(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    expert_bytes, embedding_bytes, other_bytes = weight_bytes(model_dir)
    num_experts = config["num_experts"]
    top_k = config.get("num_experts_per_tok") or config["num_experts_per_token"]
    state_elements, kv_bytes_per_token = cache_sizes(config)
    active_params = (other_bytes + expert_bytes * top_k / num_experts) / 2  # per token, embedding excluded
    prompts, max_tokens = random_workload(args.num_prompts, (100, 1024), (100, 1024), 0, 10000)
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(max_tokens)
    prefill_seconds = prompt_tokens * 2 * active_params / (args.tflops * 1e12)
    print(f"weights: experts {expert_bytes / GiB:.2f} GiB, embedding {embedding_bytes / GiB:.2f} GiB, "
          f"other {other_bytes / GiB:.2f} GiB; {active_params / 1e9:.2f} B active params per token")
    print(f"workload: {args.num_prompts} requests, {prompt_tokens:,} prompt + {output_tokens:,} output tokens; "
          f"prefill floor {prefill_seconds:.2f} s at {args.tflops:.0f} TFLOP/s")
    for state_name, state_itemsize in (("float32", 4), ("bfloat16", 2)):
        decode_seconds, step_at_full_batch = 0.0, None
        bucket_seconds, bucket_steps = collections.Counter(), collections.Counter()
        for step in range(max(max_tokens)):
            running = [index for index in range(args.num_prompts) if max_tokens[index] > step]
            batch = len(running)
            touched = num_experts * (1 - (1 - top_k / num_experts) ** batch)
            context_tokens = sum(len(prompts[index]) + step for index in running)
            step_bytes = (other_bytes + touched / num_experts * expert_bytes
                          + 2 * state_elements * state_itemsize * batch + context_tokens * kv_bytes_per_token)
            decode_seconds += step_bytes / args.bandwidth
            bucket = next(label for low, label in BUCKETS if batch >= low)
            bucket_seconds[bucket] += step_bytes / args.bandwidth
            bucket_steps[bucket] += 1
            if step_at_full_batch is None:
                step_at_full_batch = step_bytes / args.bandwidth
        total = decode_seconds + prefill_seconds
        ceiling = output_tokens / total
        peer = f", {ceiling / args.peer:.2f}x the peer's {args.peer:,.0f}" if args.peer else ""
        print(f"{state_name} state: decode floor {decode_seconds:.2f} s (a batch-{args.num_prompts} step "
              f"{step_at_full_batch * 1e3:.1f} ms), with prefill {total:.2f} s = at most "
              f"{ceiling:,.0f} output tok/s{peer}")
        per_step = [f"{label} {bucket_steps[label]} steps {bucket_seconds[label] / bucket_steps[label] * 1e3:.2f} ms"
                    for _, label in BUCKETS if bucket_steps[label]]
        print("  per step: " + ", ".join(per_step))


if __name__ == "__main__":
    main()
