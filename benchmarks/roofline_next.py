"""The floor of a MoE model's nano-bench (or long-context) workload: how fast any engine could run it.

    python3 -m benchmarks.roofline_next [benchmarks/models/qwen3-next-24l] [--bandwidth 4.3e12] [--peer 5662]
    python3 -m benchmarks.roofline_next benchmarks/models/kimi-linear-48b --peer 3917
    python3 -m benchmarks.roofline_next benchmarks/models/deepseek-v32-7l --peer 4905
    python3 -m benchmarks.roofline_next benchmarks/models/deepseek-v32-7l --workload longctx --peer 585

Qwen3-Next (Gated DeltaNet + full attention), Kimi Linear (Kimi Delta Attention + MLA, whose
cache is one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer) and
DeepSeek-V3 / V3.2 (MLA on every layer; V3.2's sparse layers also keep an indexer key per token,
charged as vLLM stores it, fp8 with an fp32 scale, and attend to at most ``index_topk`` keys).

Per decode batch-size bucket it also prints the floor's mean ms per step, to set beside the
buckets of ``benchmarks/profile_steps.py`` (where a real run loses its time).

A decode step must read every weight it uses once: the non-expert weights (all but the
embedding, of which it gathers a few rows), every expert some token of the batch routed to, each
running request's recurrent state (read and written back; conv states are left out, under 1%
of it) and its KV cache. Routing is taken as
uniform (random weights route close to that): a batch of ``b`` tokens touches
``E * (1 - (1 - k/E)^b)`` of the ``E`` experts on average. MLA's decode attention is charged its
absorbed-form FLOPs too (128 heads over a shared latent make it compute-bound at long contexts):
a step takes the longer of its bytes at ``--bandwidth`` and its FLOPs at ``--tflops``.
Prefill is charged its matmul FLOPs at ``--tflops``: every active weight once per prompt token
(the LM head once per request), plus MLA's attention in the cheaper expanded form (640 FLOPs per
query, key and head) and V3.2's indexer scores for queries past ``index_topk``; prefill also
gives each request its first output token, so a request of ``m`` tokens decodes ``m - 1`` steps.
Requests are assumed to all decode from the first step (no prefill in between), which only lowers
the floor. Two totals: prefill then decode (the sum), and the floor proper, for an engine that hides
prefill FLOPs under the weight streaming of decode steps (chunked prefill in mixed steps):
the longer of all decode bytes at ``--bandwidth`` and all FLOPs at ``--tflops``. The ceiling is
that floor's. No kernel reaches the device's copy bandwidth on every byte, so a real engine sits
above these times; the ratio measured / floor says how close it gets.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
import transformers

from benchmarks.profile_steps import BUCKETS
from benchmarks.race import LONGCTX_RANGE, LONGCTX_REQUESTS, NANO_RANGE
from weir.cli.bench.throughput import parse_random_range, random_workload

GiB = 2**30


def weight_bytes(model_dir: Path) -> tuple[int, int, int, int]:
    """(expert, embedding, LM head, other) weight bytes in bf16, counted on a meta-device
    transformers model."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expert = embedding = head = other = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * 2
        if ".experts." in name:
            expert += size
        elif "embed_tokens" in name:
            embedding += size
        elif name.startswith("lm_head"):
            head += size
        else:
            other += size
    return expert, embedding, head, other


class AttentionCost:
    """Bytes and FLOPs of a family's attention: per decode step over its requests' context
    lengths, and per prefilled prompt."""

    def __init__(self, config: dict):
        self.state_elements = 0  # recurrent-state elements per request (all linear layers)
        self.kv_bytes_per_token = 0  # bf16 KV-cache bytes per token read whole by decode
        self.mla_layers = 0  # layers whose decode attention is charged absorbed MLA FLOPs
        self.sparse = False  # those are DSA layers (indexer + top-k attention), V3.2's all of them
        self.latent_bytes = self.index_key_bytes = self.index_flops = self.topk = self.heads = 0
        # MLA's FLOPs per (query, key, head): absorbed (decode: q . [c, k_pe], then p . c) and
        # expanded (prefill: q . k over the nope and rope dims, then p . v).
        self.absorbed_flops = self.expanded_flops = 0
        if config["model_type"] == "kimi_linear":
            linear = config["linear_attn_config"]
            self.state_elements = len(linear["kda_layers"]) * linear["num_heads"] * linear["head_dim"] ** 2
            latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
            self.kv_bytes_per_token = len(linear["full_attn_layers"]) * latent * 2
        elif config["model_type"] in ("deepseek_v3", "deepseek_v32"):
            self.mla_layers, self.heads = config["num_hidden_layers"], config["num_attention_heads"]
            lora, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
            self.latent_bytes = (lora + rope) * 2
            self.absorbed_flops = 2 * (lora + rope) + 2 * lora
            self.expanded_flops = 2 * (config["qk_nope_head_dim"] + rope) + 2 * config["v_head_dim"]
            if config["model_type"] == "deepseek_v32":
                self.sparse, self.topk = True, config["index_topk"]
                self.index_key_bytes = config["index_head_dim"] + 4  # fp8 and an fp32 scale
                self.index_flops = 2 * config["index_n_heads"] * config["index_head_dim"]  # per (query, key)
        else:
            layer_types = config.get("layer_types") or [
                "full_attention" if (index + 1) % config["full_attention_interval"] == 0 else "linear_attention"
                for index in range(config["num_hidden_layers"])]
            self.state_elements = (layer_types.count("linear_attention") * config["linear_num_value_heads"]
                                   * config["linear_key_head_dim"] * config["linear_value_head_dim"])
            self.kv_bytes_per_token = (layer_types.count("full_attention") * 2 * config["num_key_value_heads"]
                                       * config["head_dim"] * 2)

    def keys_attended(self, context: int) -> int:
        return min(context, self.topk) if self.sparse else context

    def decode(self, contexts: list[int], state_itemsize: int) -> tuple[float, float]:
        """(bytes, FLOPs) of one decode step of requests with these context lengths."""
        step_bytes = 2 * self.state_elements * state_itemsize * len(contexts) + sum(contexts) * self.kv_bytes_per_token
        flops = 0.0
        for context in contexts:
            keys = self.keys_attended(context)
            step_bytes += self.mla_layers * keys * self.latent_bytes
            flops += self.mla_layers * keys * self.heads * self.absorbed_flops
            if self.sparse and context > self.topk:  # the indexer scores every key
                step_bytes += self.mla_layers * context * self.index_key_bytes
                flops += self.mla_layers * context * self.index_flops
        return step_bytes, flops

    def prefill_flops(self, prompt_len: int) -> float:
        """Attention FLOPs of prefilling one prompt (MLA families only): expanded attention over
        each query's keys, and the indexer over the causal prefix where it must choose."""
        if not self.mla_layers:
            return 0.0
        flops = 0.0
        for position in range(prompt_len):
            keys = self.keys_attended(position + 1)
            flops += self.mla_layers * keys * self.heads * self.expanded_flops
            if self.sparse and position + 1 > self.topk:
                flops += self.mla_layers * (position + 1) * self.index_flops
        return flops


def workload(name: str, num_prompts: int | None) -> tuple[list[list[int]], list[int]]:
    """The race's workloads (``benchmarks/race.py``): nano-bench, or its long-context batch."""
    text, default_prompts = (NANO_RANGE, 256) if name == "nano" else (LONGCTX_RANGE, LONGCTX_REQUESTS)
    input_range, output_range = parse_random_range(text)
    return random_workload(num_prompts or default_prompts, input_range, output_range, 0, 10000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="benchmarks/models/qwen3-next-24l")
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s a kernel can stream")
    parser.add_argument("--tflops", type=float, default=700.0, help="bf16 matmul TFLOP/s charged to prefill")
    parser.add_argument("--workload", choices=("nano", "longctx"), default="nano",
                        help=f"nano-bench (lengths {NANO_RANGE}) or the long-context batch ({LONGCTX_RANGE})")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"requests (default 256 for nano, {LONGCTX_REQUESTS} for longctx)")
    parser.add_argument("--peer", type=float, default=None, help="a peer's output tok/s, for the ceiling ratio")
    args = parser.parse_args()
    model_dir = Path(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    expert_bytes, embedding_bytes, head_bytes, other_bytes = weight_bytes(model_dir)
    num_experts = config.get("num_experts") or config["n_routed_experts"]
    top_k = config.get("num_experts_per_tok") or config["num_experts_per_token"]
    attention = AttentionCost(config)
    active_params = (other_bytes + expert_bytes * top_k / num_experts) / 2  # per token, embedding and head excluded
    prompts, max_tokens = workload(args.workload, args.num_prompts)
    num_prompts, prompt_tokens, output_tokens = len(prompts), sum(map(len, prompts)), sum(max_tokens)
    prefill_flops = (prompt_tokens * 2 * active_params + num_prompts * head_bytes
                     + sum(attention.prefill_flops(len(prompt)) for prompt in prompts))
    prefill_seconds = prefill_flops / (args.tflops * 1e12)
    print(f"weights: experts {expert_bytes / GiB:.2f} GiB, embedding {embedding_bytes / GiB:.2f} GiB, "
          f"LM head {head_bytes / GiB:.2f} GiB, other {other_bytes / GiB:.2f} GiB; "
          f"{active_params / 1e9:.2f} B active params per token")
    print(f"workload {args.workload}: {num_prompts} requests, {prompt_tokens:,} prompt + {output_tokens:,} output "
          f"tokens; prefill floor {prefill_seconds:.2f} s at {args.tflops:.0f} TFLOP/s")
    for state_name, state_itemsize in (("float32", 4), ("bfloat16", 2)) if attention.state_elements else (("no", 0),):
        decode_seconds, decode_bytes_seconds, decode_flops, step_at_full_batch = 0.0, 0.0, 0.0, 0.0
        bucket_seconds, bucket_steps = collections.Counter(), collections.Counter()
        compute_bound_steps, num_steps = 0, max(max_tokens) - 1  # prefill gave each its first token
        for step in range(num_steps):
            running = [index for index in range(num_prompts) if max_tokens[index] - 1 > step]
            batch = len(running)
            touched = num_experts * (1 - (1 - top_k / num_experts) ** batch)
            cache_bytes, attention_flops = attention.decode(
                [len(prompts[index]) + 1 + step for index in running], state_itemsize)
            step_bytes = other_bytes + head_bytes + touched / num_experts * expert_bytes + cache_bytes
            step_flops = 2 * batch * (active_params + head_bytes / 2) + attention_flops
            step_seconds = max(step_bytes / args.bandwidth, step_flops / (args.tflops * 1e12))
            compute_bound_steps += step_seconds > step_bytes / args.bandwidth
            decode_seconds += step_seconds
            decode_bytes_seconds += step_bytes / args.bandwidth
            decode_flops += step_flops
            bucket = next(label for low, label in BUCKETS if batch >= low)
            bucket_seconds[bucket] += step_seconds
            bucket_steps[bucket] += 1
            if step == 0:
                step_at_full_batch = step_seconds
        sequential = decode_seconds + prefill_seconds
        total = max(decode_bytes_seconds, (prefill_flops + decode_flops) / (args.tflops * 1e12))
        ceiling = output_tokens / total
        peer = f", {ceiling / args.peer:.2f}x the peer's {args.peer:,.0f}" if args.peer else ""
        sequential_peer = f", {output_tokens / sequential / args.peer:.2f}x" if args.peer else ""
        bound = f" ({compute_bound_steps} of {num_steps} steps FLOP-bound)" if compute_bound_steps else ""
        print(f"{state_name} state: decode floor {decode_seconds:.2f} s (a batch-{num_prompts} step "
              f"{step_at_full_batch * 1e3:.1f} ms){bound}; prefill then decode {sequential:.2f} s "
              f"({output_tokens / sequential:,.0f} output tok/s{sequential_peer}); prefill hidden under decode "
              f"{total:.2f} s = at most {ceiling:,.0f} output tok/s{peer}")
        per_step = [f"{label} {bucket_steps[label]} steps {bucket_seconds[label] / bucket_steps[label] * 1e3:.2f} ms"
                    for _, label in BUCKETS if bucket_steps[label]]
        print("  per step: " + ", ".join(per_step))


if __name__ == "__main__":
    main()
