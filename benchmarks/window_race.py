"""What a sliding window buys: a windowed model against the same model with every layer full.

Usage (on the GPU machine; vLLM on PYTHONPATH unless --skip-vllm):
    python3 benchmarks/window_race.py OUT_DIR [--model granite-swa-2b] [--skip-vllm]
``--model`` names a folder of benchmarks/models (config only: random weights, token-id prompts,
no tokenizer). Two workloads: nano-bench (256 requests, prompt and output lengths uniform in
[100, 1024]) and long context (``--long-requests`` requests of 3,000 prompt and 512 output
tokens). Each runs on the model as configured (its windowed layers free the blocks that fall
out of the window) and on a copy whose ``layer_types`` are all full attention: the same weights'
shapes and FLOPs per token, but every layer keeps every token. Writes OUT_DIR/window-race-<model>-<date>.{json,md}
(output tok/s, the KV cache's context tokens, preemptions) and OUT_DIR/latest-records-window-<model>.json.
vLLM runs the windowed model too when it knows the architecture; otherwise its error is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from race import HERE, run, versions

WORKLOADS = {  # name -> (bench throughput options, description)
    "nano": (["--num-prompts", "256", "--random-range", "100:1024,100:1024"],
             "256 requests, prompt and output lengths uniform in [100, 1024]"),
    "longctx": (["--input-len", "3000", "--output-len", "512"], "prompts of 3,000 tokens, 512 outputs"),
}


def as_full_attention(model: Path, out_dir: Path) -> Path:
    """A copy of the model folder whose every layer is full attention."""
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    folder = out_dir / f"{model.name}-as-full"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def weir_run(model: Path, workload: str, out_dir: Path, num_long: int) -> dict:
    options = list(WORKLOADS[workload][0])
    if workload == "longctx":
        options = ["--num-prompts", str(num_long), *options]
    name = f"weir-{model.name}-{workload}"
    result_file = out_dir / f"{name}.json"
    run([sys.executable, "-m", "weir.cli.main", "bench", "throughput", str(model), "--load-format", "dummy",
         "--skip-tokenizer-init", "--temperature", "0.6", "--max-model-len", "4096",
         "--gpu-memory-utilization", "0.9", "--seed", "0", "--output-json", str(result_file), *options],
        out_dir / f"{name}.log")
    return json.loads(result_file.read_text())


def vllm_run(model: Path, out_dir: Path) -> dict:
    """vLLM's nano-bench figure on the windowed model, or the reason it could not run it."""
    log = out_dir / f"vllm-{model.name}.log"
    try:
        stdout = run([sys.executable, str(HERE / "peers" / "bench_vllm.py"), str(model), "256"], log,
                     env={"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_EXTRA": json.dumps({"skip_tokenizer_init": True})})
    except SystemExit:
        lines = [line for line in log.read_text().splitlines() if "Error" in line or "not supported" in line]
        return {"error": lines[-1] if lines else "failed: see the log", "log": log.name}
    for line in stdout.splitlines():
        if line.startswith("RESULT vllm num_seqs=256"):
            return {"output_tokens_per_second": float(line.rsplit("out_tok/s=", 1)[1].split()[0])}
    return {"error": "no RESULT line", "log": log.name}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default="granite-swa-2b", help="a folder of benchmarks/models")
    parser.add_argument("--long-requests", type=int, default=512, help="requests of the long-context workload")
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    date, info = datetime.date.today().isoformat(), versions()
    windowed = HERE / "models" / args.model
    full = as_full_attention(windowed, args.out_dir)
    results = {}
    for workload in WORKLOADS:
        for label, model in (("windowed", windowed), ("as-full", full)):
            results[workload, label] = result = weir_run(model, workload, args.out_dir, args.long_requests)
            # Named as a reader finds them, not by this machine's paths.
            result["model"] = f"benchmarks/models/{args.model}" if model == windowed else f"OUT_DIR/{full.name}"
            print(f"weir {args.model} {label} {workload}: {result['output_tokens_per_second']:,.0f} out tok/s, "
                  f"{result['kv_cache_tokens']:,} context tokens, {result['num_preemptions']} preemptions", flush=True)
    peer = None if args.skip_vllm else vllm_run(windowed, args.out_dir)

    records, lines = [], [
        f"# {args.model}: sliding windows against every layer full, {date}", "",
        f"{info['gpu']}; torch {info['torch']}, triton {info['triton']}, Weir from this commit. Random weights, "
        "token-id prompts, temperature 0.6, ignore EOS, max_model_len 4096, gpu_memory_utilization 0.9.",
        f"Command: `python3 benchmarks/window_race.py OUT --model {args.model} --long-requests {args.long_requests}`",
        "", "| workload | layers | output tok/s | KV context tokens | preemptions |", "|---|---|---|---|---|"]
    for (workload, label), result in results.items():
        description = WORKLOADS[workload][1] if workload == "nano" else \
            f"{args.long_requests} requests, {WORKLOADS[workload][1]}"
        lines.append(f"| {description} | {label} | {result['output_tokens_per_second']:,.0f} | "
                     f"{result['kv_cache_tokens']:,} | {result['num_preemptions']} |")
    for workload in WORKLOADS:
        ours, theirs = results[workload, "windowed"], results[workload, "as-full"]
        records.append({"workload": f"{args.model}-{workload}", "metric": "output_tokens_per_second",
                        "weir": round(ours["output_tokens_per_second"], 1), "peer": "weir-as-full-attention",
                        "peer_value": round(theirs["output_tokens_per_second"], 1),
                        "ratio": round(ours["output_tokens_per_second"] / theirs["output_tokens_per_second"], 3),
                        "date": date, "device": info["gpu"]})
    records.append({"workload": f"{args.model}-kv-capacity", "metric": "kv_context_tokens",
                    "weir": results["nano", "windowed"]["kv_cache_tokens"], "peer": "weir-as-full-attention",
                    "peer_value": results["nano", "as-full"]["kv_cache_tokens"],
                    "ratio": round(results["nano", "windowed"]["kv_cache_tokens"]
                                   / results["nano", "as-full"]["kv_cache_tokens"], 3),
                    "date": date, "device": info["gpu"]})
    if peer is not None:
        lines += ["", f"vLLM {info['vllm']} on the windowed model (nano-bench): "
                  + (f"{peer['output_tokens_per_second']:,.0f} out tok/s" if "error" not in peer
                     else f"did not run: {peer['error']} (log {peer['log']})")]
        if "error" not in peer:
            ours = results["nano", "windowed"]["output_tokens_per_second"]
            records.append({"workload": f"{args.model}-nano-vllm", "metric": "output_tokens_per_second",
                            "weir": round(ours, 1), "peer": f"vllm-{info['vllm']}",
                            "peer_value": peer["output_tokens_per_second"],
                            "ratio": round(ours / peer["output_tokens_per_second"], 3), "date": date,
                            "device": info["gpu"]})
    report = {"date": date, "versions": info, "weir": {f"{w}-{label}": r for (w, label), r in results.items()},
              "vllm": peer, "records": records}
    (args.out_dir / f"window-race-{args.model}-{date}.json").write_text(json.dumps(report, indent=2))
    (args.out_dir / f"latest-records-window-{args.model}.json").write_text(json.dumps(records, indent=2))
    (args.out_dir / f"window-race-{args.model}-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
