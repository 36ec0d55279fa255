"""Where a nano-bench run's time goes, step by step: wall time per step bucketed by kind (prefill or
mixed vs pure decode) and decode batch size, then a torch-profiler table of a steady decode window.

    python3 -m benchmarks.profile_steps benchmarks/models/qwen3-next-24l [--num-prompts 256] [--profile-batch 256]
    python3 -m benchmarks.profile_steps benchmarks/models/qwen3-8b --num-prompts 0 --profile-batch 1 --top 30
    python3 -m benchmarks.profile_steps benchmarks/models/qwen3-next-24l --num-prompts 0 --profile-batch "" \
        --profile-prefill 16x1024   # one prefill step of 16 prompts of 1024 tokens
    python3 -m benchmarks.profile_steps benchmarks/models/deepseek-v32-7l --num-prompts 0 --profile-batch "" \
        --expert-spread 256         # how the random weights' router spreads tokens over the experts
    python3 -m benchmarks.profile_steps benchmarks/models/deepseek-v32-7l --max-model-len 16640 \
        --num-prompts 32 --random-range 8192:16384,256:256 --profile-batch 32 --profile-context 12288
                                    # the race's long-context workload, and decode over long prompts
"""

from __future__ import annotations

import argparse
import collections
import logging
import time
from pathlib import Path

import torch

from weir import LLM, SamplingParams
from weir.cli.bench.throughput import parse_random_range, random_workload

from benchmarks.race import has_tokenizer

# Decode batch-size buckets (lowest batch size, label); benchmarks/roofline_next.py uses the same.
BUCKETS = ((192, "decode 192+"), (128, "decode 128-191"), (64, "decode 64-127"), (16, "decode 16-63"),
           (1, "decode 1-15"))


def bucket_of(num_reqs: int, num_tokens: int) -> str:
    if num_reqs == 0:
        return "idle"
    if num_tokens > num_reqs:
        return "prefill/mixed"
    return next(label for low, label in BUCKETS if num_reqs >= low)


def timed_steps(llm, prompts, max_tokens) -> None:
    engine = llm.engine
    seconds, counts = collections.Counter(), collections.Counter()
    for index, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=limit), final_only=True)
    original_execute = engine.runner.execute
    current = {}

    def execute(out):
        current["bucket"] = bucket_of(len(out.num_scheduled_tokens), out.total_num_scheduled_tokens)
        return original_execute(out)

    engine.runner.execute = execute
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        seconds[current.get("bucket", "idle")] += time.perf_counter() - step_start
        counts[current.get("bucket", "idle")] += 1
    total = time.perf_counter() - start
    engine.runner.execute = original_execute
    print(f"run: {total:.2f} s, {sum(max_tokens) / total:,.0f} out tok/s")
    for label in ["prefill/mixed"] + [label for _, label in BUCKETS]:
        if counts[label]:
            print(f"  {label:15s} {counts[label]:5d} steps  {seconds[label]:6.2f} s  "
                  f"{seconds[label] / counts[label] * 1e3:7.2f} ms/step")


def largest_token_id(engine) -> int:
    """The nano-bench workload's token bound (10000), inside the model's vocabulary."""
    return min(10000, engine.config.model.vocab_size - 1)


def profile_window(llm, batch: int, top: int, context: int = 399, num_steps: int = 6) -> None:
    engine = llm.engine
    # Prompts of their own, as a real batch has: one prompt for all would hit the prefix cache and
    # route every request's tokens to the same experts (a MoE step would stream far fewer).
    prompts, _ = random_workload(batch, (context, context), (1, 1), 1, largest_token_id(engine))
    for index, prompt in enumerate(prompts):
        engine.add_request(f"p{index}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=200))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 100
    print(f"steady decode at batch {batch} over {context}-token prompts: {step_ms:.2f} ms/step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_request([f"p{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    total = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    launches = sum(event.count for event in events) / num_steps
    print(f"device busy {total / 1e3 / num_steps:.2f} ms/step in {launches:.0f} kernels; top kernels (us per step):")
    for event in sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:top]:
        print(f"  {event.self_device_time_total / num_steps:9.1f}  {event.count / num_steps:5.1f}x  {event.key[:90]}")


def profile_prefill(llm, shape: str, top: int) -> None:
    """Kernel table of one step that prefills ``NUMxLEN`` prompts (the engine's chunk permitting)."""
    num_prompts, prompt_len = (int(part) for part in shape.split("x"))
    engine = llm.engine
    vocab_size = engine.config.model.vocab_size
    for warm_up in (True, False):
        ids = [f"{'w' if warm_up else 'f'}{index}" for index in range(num_prompts)]
        for index, request_id in enumerate(ids):
            # Warm-up prompts of their own: the profiled step must not find them in the prefix cache.
            seed = index + (num_prompts if warm_up else 0)
            prompt = [(seed * 7919 + position) % min(10000, vocab_size) for position in range(prompt_len)]
            engine.add_request(request_id, {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1))
        torch.cuda.synchronize()
        start = time.perf_counter()
        if warm_up:
            engine.step()
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        while engine.has_unfinished_requests():
            engine.step()
    print(f"prefill step of {num_prompts}x{prompt_len} tokens: {elapsed_ms:.1f} ms wall (profiler attached)")
    events = prof.key_averages()
    total = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    print(f"device busy {total / 1e3:.2f} ms; top kernels (us):")
    for event in sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:top]:
        print(f"  {event.self_device_time_total:9.1f}  {event.count:5d}x  {event.key[:90]}")


def expert_spread(llm, batch: int, num_prompts: int = 16, seed: int = 0) -> None:
    """How the router spreads tokens over the routed experts, per MoE layer, from one prefill of
    random prompts: the busiest expert's share against the mean, and the distinct experts that
    ``batch`` tokens of that prefill drawn at random touch (a decode batch of ``batch`` requests,
    whose expert weights a step must stream) against what uniform routing would touch. Random
    weights route however they happen to: an engine whose router sends every token to the same
    few experts streams a fraction of the bytes a trained model's decode step does."""
    engine = llm.engine
    backend = engine.runner.moe_backend
    if backend is None:
        raise SystemExit("--expert-spread: this model has no MoE layers")
    calls = []  # (num_experts, routed ids [num_tokens, top_k]) of each eager route() call
    original_route = backend.route

    def route(router_logits, routing, *args, **kwargs):
        weights, ids = original_route(router_logits, routing, *args, **kwargs)
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            calls.append((routing.num_experts, ids[:, :routing.top_k].detach().clone()))
        return weights, ids

    backend.route = route
    try:
        prompts, _ = random_workload(num_prompts, (512, 512), (1, 1), seed, largest_token_id(engine))
        for index, prompt in enumerate(prompts):
            engine.add_request(f"s{index}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1))
        engine.step()  # one prefill step: 16x512 tokens fit the default token budget
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del backend.route
    prefill = [(num_experts, ids) for num_experts, ids in calls if ids.shape[0] == num_prompts * 512]
    if not prefill:
        raise SystemExit(f"--expert-spread: no eager route() call of the {num_prompts * 512}-token prefill was seen")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    print(f"expert spread over a prefill of {num_prompts}x512 random tokens, and of {batch} of its tokens:")
    for layer, (num_experts, ids) in enumerate(prefill):
        top_k = ids.shape[1]
        load = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts).float()  # [num_experts]
        rows = torch.randperm(ids.shape[0], generator=generator)[:batch]
        touched = ids.cpu()[rows].unique().numel()
        uniform = num_experts * (1 - (1 - top_k / num_experts) ** batch)
        print(f"  MoE layer {layer}: busiest expert {load.max() / load.mean():.1f}x the mean load, "
              f"{int((load > 0).sum())}/{num_experts} experts used; {batch} tokens touch {touched} "
              f"(uniform routing: {uniform:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--random-range", default="100:1024,100:1024", metavar="IMIN:IMAX,OMIN:OMAX",
                        help="prompt and output lengths of the timed run (the nano-bench's by default)")
    parser.add_argument("--profile-batch", default="256,32")
    parser.add_argument("--profile-context", type=int, default=399, help="prompt length of the decode windows")
    parser.add_argument("--top", type=int, default=14, help="kernels listed per profiled window")
    parser.add_argument("--linear-state-dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096, help="longer for --profile-prefill of long prompts")
    parser.add_argument("--profile-prefill", default=None, metavar="NUMxLEN",
                        help="also profile one step prefilling NUM prompts of LEN tokens")
    parser.add_argument("--expert-spread", type=int, default=None, metavar="BATCH",
                        help="also report how the router spreads tokens over experts (MoE models)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    start = time.perf_counter()
    options = {"linear_state_dtype": args.linear_state_dtype} if args.linear_state_dtype else {}
    if not has_tokenizer(Path(args.model)):
        options["skip_tokenizer_init"] = True
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, seed=0, **options)
    print(f"STARTUP {time.perf_counter() - start:.1f} s")
    logging.getLogger().setLevel(logging.WARNING)
    if args.num_prompts:
        prompts, max_tokens = random_workload(args.num_prompts, *parse_random_range(args.random_range), 0, 10000)
        timed_steps(llm, prompts, max_tokens)
    for batch in filter(None, args.profile_batch.split(",")):
        profile_window(llm, int(batch), args.top, args.profile_context)
    if args.profile_prefill:
        profile_prefill(llm, args.profile_prefill, args.top)
    if args.expert_spread:
        expert_spread(llm, args.expert_spread)


if __name__ == "__main__":
    main()
