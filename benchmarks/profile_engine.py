"""Where Weir's time goes on the nano-bench: start-up phases, the timed run twice (cold and warm
kernels), and a torch-profiler window of steady decode steps with the device syncs counted.

    python3 benchmarks/profile_engine.py [MODEL_DIR] [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import collections
import logging
import time

import torch

from weir import LLM, SamplingParams
from weir.cli.bench.throughput import random_workload

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
              "cudaMemcpyAsync")


def timed_run(llm, prompts, max_tokens) -> float:
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def profile_decode_steps(llm, prompts, num_steps: int) -> None:
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"p{index}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=400))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    step_times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    engine.abort_request([f"p{i}" for i in range(len(prompts))])
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    syncs = collections.Counter()
    device_us = 0.0
    for event in events:
        if any(event.key.startswith(name) for name in SYNC_CALLS):
            syncs[event.key] += event.count
        device_us += getattr(event, "self_device_time_total", 0.0) or 0.0
    wall = sum(step_times)
    print(f"decode window: {num_steps} steps, batch {len(prompts)}, wall {wall * 1e3 / num_steps:.2f} ms/step, "
          f"device busy {device_us / 1e3 / num_steps:.2f} ms/step")
    for name, count in sorted(syncs.items()):
        print(f"  {name}: {count / num_steps:.2f} per step")
    print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default="benchmarks/models/qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    start = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, seed=0)
    print(f"STARTUP {time.perf_counter() - start:.1f} s")
    logging.getLogger().setLevel(logging.WARNING)
    prompts, max_tokens = random_workload(args.num_prompts, (100, 1024), (100, 1024), 0, 10000)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=16), use_tqdm=False)
    compiled = collections.Counter()

    def count_compile(*args, **kwargs):
        compiled[kwargs.get("repr", "?").split("[")[0]] += 1

    try:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = count_compile
    except AttributeError:
        print("this Triton has no jit_post_compile_hook: compiles are not counted")
    for attempt in ("first", "second"):
        elapsed = timed_run(llm, prompts, max_tokens)
        print(f"nano-bench {attempt} run: {elapsed:.2f} s, {sum(max_tokens) / elapsed:,.0f} out tok/s; "
              f"kernels compiled during it: {dict(compiled) or 'none'}")
        compiled.clear()
    profile_decode_steps(llm, prompts, num_steps=30)


if __name__ == "__main__":
    main()
