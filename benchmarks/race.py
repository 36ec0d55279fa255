"""The race: Weir and vLLM on the same GPU in one run, nano-bench workloads.

Usage (on the GPU machine, vLLM unpacked on PYTHONPATH):
    python3 benchmarks/race.py OUT_DIR [--sizes 256,1024] [--skip-vllm]
Writes OUT_DIR/race-<date>.json and .md with both engines' figures and the Weir/vLLM ratio, and
OUT_DIR/latest-records.json in the benchmarks/results/latest.json record shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / "models" / "qwen3-0.6b"


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: int = 900) -> str:
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    log.write_text(f"$ {' '.join(cmd)}\n[rc={proc.returncode}, {time.time() - start:.0f} s]\n"
                   f"{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        raise SystemExit(f"failed: {' '.join(cmd)} (log {log})")
    return proc.stdout


def weir_throughput(size: int, out_dir: Path) -> dict:
    result_file = out_dir / f"weir-{size}.json"
    run([sys.executable, "-m", "weir.cli.main", "bench", "throughput", str(MODEL), "--load-format", "dummy",
         "--num-prompts", str(size), "--random-range", "100:1024,100:1024", "--temperature", "0.6",
         "--max-model-len", "4096", "--gpu-memory-utilization", "0.9", "--seed", "0",
         "--output-json", str(result_file)], out_dir / f"weir-{size}.log")
    return json.loads(result_file.read_text())


def vllm_throughput(sizes: list[int], out_dir: Path) -> tuple[float, dict[int, float]]:
    stdout = run([sys.executable, str(HERE / "peers" / "bench_vllm.py"), str(MODEL), ",".join(map(str, sizes))],
                 out_dir / "vllm.log", env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    startup = float(re.search(r"STARTUP ([\d.]+)s", stdout).group(1))
    rates = {int(m.group(1)): float(m.group(2))
             for m in re.finditer(r"RESULT vllm num_seqs=(\d+) .* out_tok/s=(\d+)", stdout)}
    return startup, rates


def versions() -> dict:
    import torch

    info = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    for name in ("triton", "transformers", "vllm"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    return info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    date = datetime.date.today().isoformat()
    info = versions()

    weir = {size: weir_throughput(size, args.out_dir) for size in sizes}
    vllm_startup, vllm_rates = (None, {}) if args.skip_vllm else vllm_throughput(sizes, args.out_dir)

    workload_id = {256: "qwen3-0.6b-nano", 1024: "qwen3-0.6b-1024"}
    records, rows = [], []
    for size in sizes:
        ours = weir[size]["output_tokens_per_second"]
        peer = vllm_rates.get(size)
        records.append({"workload": workload_id.get(size, f"qwen3-0.6b-{size}"), "metric": "output_tokens_per_second",
                        "weir": round(ours, 1), "peer": "vllm-0.26.0", "peer_value": peer,
                        "ratio": round(ours / peer, 3) if peer else None, "date": date, "device": info["gpu"]})
        rows.append((f"{size} requests, output tok/s", f"{ours:,.0f}", f"{peer:,.0f}" if peer else "-",
                     f"{ours / peer:.2f}" if peer else "-"))
    weir_startup = weir[sizes[0]]["startup_seconds"]
    records.append({"workload": "startup-qwen3-0.6b", "metric": "startup_seconds", "weir": round(weir_startup, 1),
                    "peer": "vllm-0.26.0", "peer_value": vllm_startup,
                    "ratio": round(weir_startup / vllm_startup, 3) if vllm_startup else None,
                    "date": date, "device": info["gpu"]})
    rows.append(("start-up to ready, s", f"{weir_startup:.1f}", f"{vllm_startup:.1f}" if vllm_startup else "-",
                 f"{weir_startup / vllm_startup:.2f}" if vllm_startup else "-"))

    command = "python3 benchmarks/race.py OUT --sizes " + args.sizes
    report = {"date": date, "versions": info, "command": command, "weir": weir,
              "vllm": {"startup_seconds": vllm_startup, "output_tokens_per_second": vllm_rates},
              "records": records}
    (args.out_dir / f"race-{date}.json").write_text(json.dumps(report, indent=2))
    (args.out_dir / "latest-records.json").write_text(json.dumps(records, indent=2))
    lines = [f"# Qwen3-0.6B nano-bench race, {date}", "",
             f"{info['gpu']}; torch {info['torch']}, triton {info['triton']}, vLLM {info['vllm']} "
             "(Model Runner V2, CUDA graphs, torch.compile), Weir from this commit.",
             "Workload: Qwen3-0.6B config, random weights, prompt and output lengths uniform in [100, 1024] "
             "(random.seed(0)), prompt tokens uniform in [0, 10000], temperature 0.6, ignore EOS, max_model_len 4096.",
             f"Command: `{command}`", "",
             "| metric | Weir | vLLM 0.26.0 | Weir / vLLM |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    (args.out_dir / f"race-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
