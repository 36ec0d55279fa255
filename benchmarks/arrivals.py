"""The engine in-process under Poisson arrivals: time to first token, and each step's host time by
kind (mixed: a prefill chunk beside decodes; decode), for option variants one after the other.

    python3 -m benchmarks.arrivals benchmarks/models/qwen3-0.6b [--rate 16] [--num-prompts 320] \
        [--variant decode-graphs='{"cudagraph_mode": "full_decode_only"}' ...]

No HTTP and no server process: what the step loop alone gives a server at that rate, and where a
serve race's time to first token goes. Random weights (``--load-format dummy``), random token-id
prompts of ``--input-len`` tokens and ``--output-len`` outputs each (ignore_eos, greedy), one set
of prompts for every variant, each variant's engine started fresh (so no variant finds another's
prompts in its prefix cache). The first row is the engine's defaults; ``--variant LABEL=JSON``
adds one with those ``weir.LLM`` options. "host ms" is the time the runner's ``execute`` takes on
the host (it returns before the device is done: asynchronous scheduling overlaps the next step);
"mixed graphs" counts the mixed steps that replayed a CUDA graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from weir import LLM, SamplingParams
from weir.cli.bench.common import percentiles


def run_variant(model: str, options: dict, prompts: list[list[int]], arrivals: list[float], output_len: int,
                max_model_len: int) -> dict:
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=max_model_len, **options)
    engine, runner = llm.engine, llm.engine.runner
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for index in range(4):  # first launches out of the timed run
        engine.add_request(f"warm{index}", {"prompt_token_ids": prompts[index][:64]}, warm)
    while engine.has_unfinished_requests():
        engine.step()
    # The warm-up prompts are the first timed ones' prefixes: no timed prompt may start cached.
    assert llm.reset_prefix_cache()

    steps, mixed_replays = [], [0]  # (mixed, host seconds) per executed step
    execute = runner.execute

    def timed_execute(out, *args, **kwargs):
        start = time.perf_counter()
        handle = execute(out, *args, **kwargs)
        steps.append((any(n > 1 for n in out.num_scheduled_tokens.values()), time.perf_counter() - start))
        return handle

    runner.execute = timed_execute
    if runner.graphs is not None:
        replay = runner.graphs.replay

        def counted_replay(size, width=1, num_tokens=None):
            mixed_replays[0] += num_tokens is not None
            return replay(size, width, num_tokens)

        runner.graphs.replay = counted_replay
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    due = [start + offset for offset in arrivals]
    ttft, added, finished = {}, 0, 0
    while finished < len(prompts):
        now = time.perf_counter()
        while added < len(prompts) and due[added] <= now:
            engine.add_request(str(added), {"prompt_token_ids": prompts[added]}, params)
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(max(due[added] - now, 0.0), 0.005))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            index = int(output.request_id)
            if index not in ttft and output.outputs[0].token_ids:
                ttft[index] = (now - due[index]) * 1e3
            finished += output.finished
    wall = time.perf_counter() - start
    runner.execute = execute
    mixed = [seconds * 1e3 for is_mixed, seconds in steps if is_mixed]
    decode = [seconds * 1e3 for is_mixed, seconds in steps if not is_mixed]
    values = list(ttft.values())
    result = {"options": options, "output_tokens_per_second": len(prompts) * output_len / wall,
              "mean_ttft_ms": statistics.mean(values), "median_ttft_ms": statistics.median(values),
              "p99_ttft_ms": percentiles(values, (99,))["p99"], "steps": len(steps), "mixed_steps": len(mixed),
              "mixed_graph_replays": mixed_replays[0],
              "mixed_host_ms": statistics.mean(mixed) if mixed else None,
              "decode_host_ms": statistics.mean(decode) if decode else None}
    del llm, engine, runner  # the next variant's engine sizes its KV cache from the memory this one frees
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, options = text.partition("=")
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError:
        parsed = None
    if not label or not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--variant wants LABEL='{{JSON options}}', got {text!r}")
    return label, parsed


def table(results: dict[str, dict]) -> list[str]:
    def number(value, digits=1):
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = ["| variant | out tok/s | mean / median / p99 TTFT ms | mixed steps (graphs) | host ms mixed / decode |",
             "| --- | --- | --- | --- | --- |"]
    for label, r in results.items():
        lines.append(f"| {label} | {number(r['output_tokens_per_second'], 0)} | {number(r['mean_ttft_ms'])} / "
                     f"{number(r['median_ttft_ms'])} / {number(r['p99_ttft_ms'])} | {r['mixed_steps']} "
                     f"({r['mixed_graph_replays']}) | {number(r['mixed_host_ms'], 2)} / {number(r['decode_host_ms'], 2)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rate", type=float, default=16.0, help="requests per second (Poisson)")
    parser.add_argument("--num-prompts", type=int, default=320)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-token-id", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", type=parse_variant, default=[], metavar="LABEL=JSON")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.num_prompts < 4 or args.input_len < 1 or args.output_len < 1:
        parser.error("--rate must be positive, --num-prompts at least 4, the lengths at least 1")
    rng = random.Random(args.seed)
    prompts = [[rng.randint(0, args.max_token_id) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    arrivals, offset = [], 0.0
    for _ in prompts:
        offset += rng.expovariate(args.rate)
        arrivals.append(offset)
    variants = [("defaults", {})] + args.variant
    results = {}
    for label, options in variants:
        results[label] = run_variant(args.model, options, prompts, arrivals, args.output_len, args.max_model_len)
        print(f"{label}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in results[label].items()})}",
              flush=True)
    print(f"\n{args.model}, {args.num_prompts} requests at {args.rate:g}/s, {args.input_len} + {args.output_len} tokens")
    print("\n".join(table(results)))
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump({"model": args.model, "rate": args.rate, "num_prompts": args.num_prompts,
                       "input_len": args.input_len, "output_len": args.output_len, "results": results}, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
