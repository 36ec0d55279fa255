"""What prefix caching saves a hybrid model: time to first token with the cache on and off.

Usage (on the GPU machine; any device with --device):
    python3 benchmarks/prefix_ttft.py OUT_DIR [--model benchmarks/models/qwen3-next-24l] [--device cuda]
        [--conversations 16] [--turns 4] [--system-prompt-len 2048] [--retention-interval 0 ...]
``--model`` is a model folder (a config alone runs with random weights). Two workloads, token-id
prompts, each run with prefix caching off and on (once per ``--retention-interval``); with
``--vllm``, vLLM runs them too, cache off and on, each in a child process that runs before any
of Weir's (so the GPU's memory is all its own; ``--vllm-only`` runs those alone, for a later
``--vllm`` run into the same OUT_DIR to reuse):
- multi-turn chat: ``--conversations`` conversations of ``--turns`` turns; turn t's prompt is turn
  t-1's prompt plus a reply and a new user message (``--reply-len``, ``--user-len`` tokens), so
  each turn's prompt extends the last one (the hit a checkpoint at a prompt's last block boundary
  gives);
- shared system prompt: ``--system-prompt-requests`` requests of one ``--system-prompt-len``-token
  system prompt plus their own user message (``--own-len-range``), in two waves (the first fills
  the cache).
Each wave is sent at once with one output token, so its wall time is the time to the first token
of its last request: the prefill work the cache saves or not; each request's own time to first
token (the end of the step that finished it) gives the mean and p99. The first wave of every
engine runs once beforehand to compile and warm it. The report also gives the memory Weir's
state checkpoints took. Writes OUT_DIR/prefix-ttft-<model>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from weir import LLM, SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


def chat_waves(args, vocab: int) -> list[list[list[int]]]:
    """Wave t holds every conversation's prompt of turn t."""
    rng = random.Random(0)
    prompts = [tokens(rng, args.user_len, vocab) for _ in range(args.conversations)]
    waves = [prompts]
    for _ in range(args.turns - 1):
        prompts = [p + tokens(rng, args.reply_len, vocab) + tokens(rng, args.user_len, vocab) for p in prompts]
        waves.append(prompts)
    return waves


def system_prompt_waves(args, vocab: int) -> list[list[list[int]]]:
    rng = random.Random(1)
    system = tokens(rng, args.system_prompt_len, vocab)
    low, high = args.own_len_range or (args.user_len, args.user_len)
    num_requests = args.system_prompt_requests or args.conversations
    return [[system + tokens(rng, rng.randint(low, high), vocab) for _ in range(num_requests)] for _ in range(2)]


def length_range(text: str) -> tuple[int, int]:
    """``100:400`` -> (100, 400)."""
    low, _, high = text.partition(":")
    try:
        bounds = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want LOW:HIGH token counts") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: want 0 < LOW <= HIGH")
    return bounds


def run_waves(llm, waves: list[list[list[int]]], params=ONE_TOKEN) -> list[dict]:
    """``llm``: Weir's or vLLM's LLM (the same generate, ``llm_engine.step`` and num_cached_tokens).
    Each request's time to first token is the end of the engine step that finished it (one
    output token), from the wave's start."""
    engine = llm.llm_engine
    original_step = engine.step
    finished_at: dict[str, float] = {}

    def step():
        outputs = original_step()
        now = time.perf_counter()
        for output in outputs:
            if output.finished:
                finished_at.setdefault(output.request_id, now)
        return outputs

    engine.step = step
    results = []
    try:
        for wave in waves:
            finished_at.clear()
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            ttfts = sorted(finished_at[o.request_id] - start for o in outputs)
            results.append({"seconds": seconds, "prompt_tokens": sum(len(p) for p in wave),
                            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs), "ttfts_s": ttfts})
    finally:
        del engine.step  # the instance attribute: the class's method again
    return results


def percentile(ascending: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return ascending[min(len(ascending) - 1, max(0, math.ceil(fraction * len(ascending)) - 1))]


def engine_options(args, caching: bool, interval: int) -> dict:
    options = {"load_format": args.load_format, "skip_tokenizer_init": True, "max_model_len": args.max_model_len,
               "enable_prefix_caching": caching, "seed": 0}
    if args.device:
        options["device"] = args.device
    if caching:
        options["prefix_cache_retention_interval"] = interval
    return options


def vllm_runs(args, workloads: dict, caching: bool) -> dict:
    """vLLM's waves with its prefix cache on or off (this process's only engine)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import vllm

    from race import VLLM_EXTRA

    llm = vllm.LLM(model=str(args.model), load_format=args.load_format, skip_tokenizer_init=True,
                   max_model_len=args.max_model_len, enable_prefix_caching=caching, seed=0,
                   gpu_memory_utilization=0.9, **VLLM_EXTRA.get(args.model.name, {}))
    params = vllm.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    per_workload = {}
    for name, waves in workloads.items():
        run_waves(llm, waves[:1], params)
        llm.reset_prefix_cache()
        per_workload[name] = run_waves(llm, waves, params)
    return {"version": vllm.__version__, "waves": per_workload}


def vllm_in_child(args, caching: bool) -> tuple[str, dict]:
    """Run ``vllm_runs`` in a child process of this script; returns (label, its waves).

    A result that an earlier ``--vllm-only`` run left in OUT_DIR with the same options is reused,
    so that vLLM's runs and Weir's can be split between two invocations."""
    result = args.out_dir / f"vllm-{'on' if caching else 'off'}.json"
    argv = [a for a in sys.argv[1:] if a not in ("--vllm", "--vllm-only")]
    done = json.loads(result.read_text()) if result.is_file() else {}
    if done.get("argv") != argv:
        subprocess.run([sys.executable, __file__, *argv, "--vllm-child", "on" if caching else "off",
                        "--vllm-result", str(result)], check=True, timeout=1800)
        done = json.loads(result.read_text()) | {"argv": argv}
        result.write_text(json.dumps(done))
    return f"vllm {done['version']} {'on' if caching else 'off'}", done["waves"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", type=Path, default=Path(__file__).resolve().parent / "models" / "qwen3-next-24l")
    parser.add_argument("--device", default=None)
    parser.add_argument("--load-format", default="dummy", help="dummy: random weights (the default)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-len", type=int, default=256)
    parser.add_argument("--reply-len", type=int, default=256)
    parser.add_argument("--system-prompt-len", type=int, default=2048)
    parser.add_argument("--system-prompt-requests", type=int, default=None,
                        help="requests per shared-system-prompt wave (default: --conversations)")
    parser.add_argument("--own-len-range", type=length_range, default=None, metavar="LOW:HIGH",
                        help="each shared-system-prompt request's own tokens, uniform (default: --user-len)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--retention-interval", type=int, action="append", default=None,
                        help="--prefix-cache-retention-interval values to run with the cache on (default: 0)")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM (installed here), cache off and on")
    parser.add_argument("--vllm-only", action="store_true",
                        help="run vLLM's two runs alone and leave them in OUT_DIR for a later --vllm run")
    parser.add_argument("--vllm-child", choices=("on", "off"), help=argparse.SUPPRESS)  # vllm_in_child's
    parser.add_argument("--vllm-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    workloads = {"chat": chat_waves(args, vocab), "system-prompt": system_prompt_waves(args, vocab)}
    longest = max(len(p) for waves in workloads.values() for wave in waves for p in wave)
    if longest >= args.max_model_len:
        raise SystemExit(f"the longest prompt has {longest} tokens; raise --max-model-len past it")
    if args.vllm_child:
        args.vllm_result.write_text(json.dumps(vllm_runs(args, workloads, args.vllm_child == "on")))
        return
    runs = [("off", False, 0)] + [(f"on, interval {n}", True, n) for n in (args.retention_interval or [0])]
    # Paths as a reader finds them (relative to the working folder), not by this machine's.
    options = {k: (os.path.relpath(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
               if k not in ("out_dir", "vllm_child", "vllm_result")}
    report = {"model": os.path.relpath(args.model), "date": datetime.date.today().isoformat(), "args": options,
              "runs": {}, "memory": {}}
    run_vllm = args.vllm or args.vllm_only
    vllm_waves = dict(vllm_in_child(args, caching) for caching in (False, True)) if run_vllm else {}
    if args.vllm_only:
        return
    for label, caching, interval in runs:
        llm = LLM(str(args.model), **engine_options(args, caching, interval))
        report["memory"][label] = state_memory(llm)
        per_workload = {}
        for name, waves in workloads.items():
            run_waves(llm, waves[:1])  # compile and warm this engine's shapes
            llm.reset_prefix_cache()
            per_workload[name] = run_waves(llm, waves)
        report["runs"][label] = per_workload
        print(label, {name: [f"{w['seconds'] * 1e3:.0f} ms ({w['cached_tokens']} cached)" for w in waves]
                      for name, waves in per_workload.items()})
        del llm
        gc.collect()
    for label, waves in vllm_waves.items():  # after Weir's: the reports compare with Weir's cache-off run
        report["runs"][label] = waves
        print(label, {name: [f"{w['seconds'] * 1e3:.0f} ms ({w['cached_tokens']} cached)" for w in ws]
                      for name, ws in waves.items()})
    stem = f"prefix-ttft-{args.model.name}-{report['date']}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out_dir / f"{stem}.md").write_text(markdown(report, workloads))
    print((args.out_dir / f"{stem}.md").read_text())


def state_memory(llm) -> dict:
    """What Weir gave the linear-attention state: running requests' slots and the prefix cache's
    checkpoints (each the size of one slot)."""
    runner = llm.engine.runner
    per_slot = runner.linear_state.bytes_per_slot if runner.linear_state is not None else 0
    return {"state_slots": runner.num_state_slots, "checkpoint_slots": runner.num_checkpoint_slots,
            "bytes_per_slot": per_slot, "checkpoint_gib": runner.num_checkpoint_slots * per_slot / 2**30}


def markdown(report: dict, workloads: dict) -> str:
    labels = list(report["runs"])
    lines = [f"# Prefix caching and time to first token, {report['model']}, {report['date']}", "",
             f"Options: {json.dumps(report['args'])}", "",
             "Each wave's requests are sent at once with one output token: the wave's wall time is its last "
             "request's time to first token. Cache on / off is the ratio of those times.", ""]
    for name, waves in workloads.items():
        lines += [f"## {name}", "", "| wave | prompt tokens | " + " | ".join(f"{label}, ms" for label in labels)
                  + " | " + " | ".join(f"{label}, cached tokens" for label in labels[1:])
                  + " | " + " | ".join(f"{label} / off" for label in labels[1:]) + " |",
                  "|" + "---|" * (2 + 3 * len(labels) - 2)]
        for index in range(len(waves)):
            row = [report["runs"][label][name][index] for label in labels]
            off = row[0]["seconds"]
            lines.append(f"| {index + 1} | {row[0]['prompt_tokens']:,} | "
                         + " | ".join(f"{r['seconds'] * 1e3:,.0f}" for r in row) + " | "
                         + " | ".join(f"{r['cached_tokens']:,}" for r in row[1:]) + " | "
                         + " | ".join(f"{r['seconds'] / off:.2f}" for r in row[1:]) + " |")
        lines += ["", "Time to first token over every request of every wave:", "",
                  "| run | mean TTFT, ms | p99 TTFT, ms |", "|---|---|---|"]
        for label in labels:
            ttfts = sorted(t for wave in report["runs"][label][name] for t in wave.get("ttfts_s", []))
            if ttfts:
                mean_ms, p99_ms = sum(ttfts) / len(ttfts) * 1e3, percentile(ttfts, 0.99) * 1e3
                lines.append(f"| {label} | {mean_ms:,.0f} | {p99_ms:,.0f} |")
        lines.append("")
    for label, memory in report.get("memory", {}).items():
        lines.append(f"- {label}: {memory['state_slots']} state slots, {memory['checkpoint_slots']} checkpoint slots "
                     f"of {memory['bytes_per_slot'] / 2**20:.1f} MiB ({memory['checkpoint_gib']:.2f} GiB)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
