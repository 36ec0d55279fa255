"""What prefix caching saves a hybrid model: time to first token with the cache on and off.

Usage (on the GPU machine; any device with --device):
    python3 benchmarks/prefix_ttft.py OUT_DIR [--model benchmarks/models/qwen3-next-24l] [--device cuda]
        [--conversations 16] [--turns 4] [--system-prompt-len 2048] [--retention-interval 0 ...]
``--model`` is a model folder (a config alone runs with random weights). Two workloads, token-id
prompts, each run with prefix caching off and on (once per ``--retention-interval``):
- multi-turn chat: ``--conversations`` conversations of ``--turns`` turns; turn t's prompt is turn
  t-1's prompt plus a reply and a new user message (``--reply-len``, ``--user-len`` tokens), so
  each turn's prompt extends the last one (the hit a checkpoint at a prompt's last block boundary
  gives);
- shared system prompt: ``--conversations`` requests of one ``--system-prompt-len``-token system
  prompt plus their own user message, in two waves (the first fills the cache).
Each wave is sent at once with one output token, so its wall time is the time to the first token
of its last request: the prefill work the cache saves or not. The first wave of every engine runs
once beforehand to compile and warm it. Writes OUT_DIR/prefix-ttft-<model>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
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
    return [[system + tokens(rng, args.user_len, vocab) for _ in range(args.conversations)] for _ in range(2)]


def run_waves(llm: LLM, waves: list[list[list[int]]]) -> list[dict]:
    results = []
    for wave in waves:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in wave], ONE_TOKEN, use_tqdm=False)
        seconds = time.perf_counter() - start
        prompt_tokens = sum(len(p) for p in wave)
        cached = sum(o.num_cached_tokens or 0 for o in outputs)
        results.append({"seconds": seconds, "prompt_tokens": prompt_tokens, "cached_tokens": cached})
    return results


def engine_options(args, caching: bool, interval: int) -> dict:
    options = {"load_format": args.load_format, "skip_tokenizer_init": True, "max_model_len": args.max_model_len,
               "enable_prefix_caching": caching, "seed": 0}
    if args.device:
        options["device"] = args.device
    if caching:
        options["prefix_cache_retention_interval"] = interval
    return options


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
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--retention-interval", type=int, action="append", default=None,
                        help="--prefix-cache-retention-interval values to run with the cache on (default: 0)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    workloads = {"chat": chat_waves(args, vocab), "system-prompt": system_prompt_waves(args, vocab)}
    longest = max(len(p) for waves in workloads.values() for wave in waves for p in wave)
    if longest >= args.max_model_len:
        raise SystemExit(f"the longest prompt has {longest} tokens; raise --max-model-len past it")
    runs = [("off", False, 0)] + [(f"on, interval {n}", True, n) for n in (args.retention_interval or [0])]
    report = {"model": str(args.model), "date": datetime.date.today().isoformat(), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": {}}
    for label, caching, interval in runs:
        llm = LLM(str(args.model), **engine_options(args, caching, interval))
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
    stem = f"prefix-ttft-{args.model.name}-{report['date']}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out_dir / f"{stem}.md").write_text(markdown(report, workloads))
    print((args.out_dir / f"{stem}.md").read_text())


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
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
