"""The race: Weir and vLLM on the same GPU in one run, nano-bench workloads.

Usage (on a CUDA machine with Weir and vLLM 0.26.0 installed, the model's tokenizer.json built by
build_tokenizer.sh):
    python3 benchmarks/race.py OUT_DIR [--model qwen3-0.6b] [--sizes 256,1024] [--skip-vllm]
                               [--variant LABEL="WEIR OPTIONS" ...]
``--model`` names a folder of benchmarks/models (config + tokenizer; weights are random).
``--variant bf16-state="--linear-state-dtype bfloat16"`` also runs Weir with those options, as an
extra row and records of workload ``<workload>-bf16-state``.
Writes OUT_DIR/race-<model>-<date>.json and .md with both engines' figures and the Weir/vLLM
ratio, and OUT_DIR/latest-records-<model>.json in the benchmarks/results/latest.json record shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# vLLM options a model needs on this machine (peers.md): flashinfer is absent, so Qwen3-Next's
# GDN prefill must use vLLM's Triton kernels; with its defaults vLLM 0.26 runs out of memory
# starting Kimi Linear 48B (CUDA-graph profiling for 1,024 sequences of KDA state).
VLLM_EXTRA = {"qwen3-next-24l": {"additional_config": {"gdn_prefill_backend": "triton"}},
              "kimi-linear-48b": {"max_num_seqs": 256, "max_num_batched_tokens": 4096}}


def has_tokenizer(model: Path) -> bool:
    """Folders that ship none (DeepSeek, Kimi Linear) run on token ids alone."""
    return (model / "tokenizer.json").is_file()


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: int = 900) -> str:
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                              timeout=timeout)
    except subprocess.TimeoutExpired as expired:  # keep what it printed: the log is the evidence
        log.write_text(f"$ {' '.join(cmd)}\n[timed out after {timeout} s]\n{expired.stdout or ''}\n"
                       f"--- stderr ---\n{expired.stderr or ''}")
        raise SystemExit(f"timed out: {' '.join(cmd)} (log {log})") from None
    log.write_text(f"$ {' '.join(cmd)}\n[rc={proc.returncode}, {time.time() - start:.0f} s]\n"
                   f"{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        raise SystemExit(f"failed: {' '.join(cmd)} (log {log})")
    return proc.stdout


def weir_throughput(model: Path, size: int, out_dir: Path, env: dict | None = None,
                    label: str = "", options: tuple[str, ...] = ()) -> dict:
    name = f"weir-{model.name}-{size}{'-' + label if label else ''}"
    result_file = out_dir / f"{name}.json"
    run([sys.executable, "-m", "weir.cli.main", "bench", "throughput", str(model), "--load-format", "dummy",
         "--num-prompts", str(size), "--random-range", "100:1024,100:1024", "--temperature", "0.6",
         "--max-model-len", "4096", "--gpu-memory-utilization", "0.9", "--seed", "0",
         *([] if has_tokenizer(model) else ["--skip-tokenizer-init"]),
         "--output-json", str(result_file), *options], out_dir / f"{name}.log", env=env)
    return json.loads(result_file.read_text())


def vllm_throughput(model: Path, sizes: list[int], out_dir: Path) -> tuple[float, dict[int, float]]:
    extra = {**VLLM_EXTRA.get(model.name, {}), **({} if has_tokenizer(model) else {"skip_tokenizer_init": True})}
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_EXTRA": json.dumps(extra)}
    stdout = run([sys.executable, str(HERE / "peers" / "bench_vllm.py"), str(model), ",".join(map(str, sizes))],
                 out_dir / f"vllm-{model.name}.log", env=env)
    startup = float(re.search(r"STARTUP ([\d.]+)s", stdout).group(1))
    rates = {int(m.group(1)): float(m.group(2))
             for m in re.finditer(r"RESULT vllm num_seqs=(\d+) .* out_tok/s=(\d+)", stdout)}
    return startup, rates


def versions() -> dict:
    import torch

    # "cpu" lets the script be tried end to end without a GPU (tiny models, --skip-vllm).
    info = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for name in ("triton", "transformers", "vllm"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    return info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default="qwen3-0.6b", help="a folder of benchmarks/models")
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--variant", action="append", default=[], metavar='LABEL="OPTIONS"',
                        help="also run Weir with these extra bench options, recorded as <workload>-LABEL")
    args = parser.parse_args()
    variants = []
    for item in args.variant:
        label, _, options = item.partition("=")
        if not re.fullmatch(r"[\w.-]+", label) or not options or label in dict(variants):
            parser.error(f"--variant {item!r}: want a distinct LABEL (letters, digits, . _ -)=\"OPTIONS\"")
        variants.append((label, tuple(shlex.split(options))))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    date = datetime.date.today().isoformat()
    info = versions()

    # Relative to the working folder: the results record it, and the machine's paths say nothing.
    model = Path(os.path.relpath(HERE / "models" / args.model))
    weir = {}
    # One Triton cache for every Weir run, empty at first: the first run's start-up (the one
    # reported) compiles and autotunes everything; later runs find it all there.
    triton_cache = {"TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="weir-race-triton-")}
    for size in sizes:  # printed at once: a later timeout must not lose them
        weir[size] = weir_throughput(model, size, args.out_dir, env=triton_cache)
        print(f"weir {args.model} {size} requests: {weir[size]['output_tokens_per_second']:,.0f} out tok/s, "
              f"start-up {weir[size]['startup_seconds']:.1f} s", flush=True)
    variant_runs = {}  # (label, size) -> result
    for label, options in variants:
        for size in sizes:
            variant_runs[label, size] = weir_throughput(model, size, args.out_dir, env=triton_cache, label=label,
                                                        options=options)
            print(f"weir {label} {args.model} {size} requests: "
                  f"{variant_runs[label, size]['output_tokens_per_second']:,.0f} out tok/s", flush=True)
    shutil.rmtree(triton_cache["TRITON_CACHE_DIR"], ignore_errors=True)
    vllm_startup, vllm_rates = (None, {}) if args.skip_vllm else vllm_throughput(model, sizes, args.out_dir)

    # The peer is named by the version that ran, not by the one this script was written against.
    peer_name = None if args.skip_vllm else f"vllm-{info['vllm'] or 'unknown'}"
    records, rows = [], []
    runs = [("", size, weir[size]) for size in sizes]
    runs += [(label, size, variant_runs[label, size]) for label, _ in variants for size in sizes]
    for label, size, result in runs:
        ours = result["output_tokens_per_second"]
        peer = vllm_rates.get(size)
        workload = (f"{args.model}-nano" if size == 256 else f"{args.model}-{size}") + (f"-{label}" if label else "")
        records.append({"workload": workload, "metric": "output_tokens_per_second",
                        "weir": round(ours, 1), "peer": peer_name, "peer_value": peer,
                        "ratio": round(ours / peer, 3) if peer else None, "date": date, "device": info["gpu"]})
        rows.append((f"{size} requests, output tok/s{f' ({label})' if label else ''}", f"{ours:,.0f}", f"{peer:,.0f}" if peer else "-",
                     f"{ours / peer:.2f}" if peer else "-"))
    weir_startup = weir[sizes[0]]["startup_seconds"]
    records.append({"workload": f"startup-{args.model}", "metric": "startup_seconds", "weir": round(weir_startup, 1),
                    "peer": peer_name, "peer_value": vllm_startup,
                    "ratio": round(weir_startup / vllm_startup, 3) if vllm_startup else None,
                    "date": date, "device": info["gpu"]})
    rows.append(("start-up to ready, s", f"{weir_startup:.1f}", f"{vllm_startup:.1f}" if vllm_startup else "-",
                 f"{weir_startup / vllm_startup:.2f}" if vllm_startup else "-"))

    command = f"python3 benchmarks/race.py OUT --model {args.model} --sizes {args.sizes}" + "".join(
        f" --variant {shlex.quote(item)}" for item in args.variant)
    report = {"date": date, "versions": info, "command": command, "weir": weir,
              "weir_variants": {f"{label}-{size}": result for (label, size), result in variant_runs.items()},
              "vllm": {"startup_seconds": vllm_startup, "output_tokens_per_second": vllm_rates},
              "records": records}
    (args.out_dir / f"race-{args.model}-{date}.json").write_text(json.dumps(report, indent=2))
    (args.out_dir / f"latest-records-{args.model}.json").write_text(json.dumps(records, indent=2))
    lines = [f"# {args.model} nano-bench race, {date}", "",
             f"{info['gpu']}; torch {info['torch']}, triton {info['triton']}, vLLM {info['vllm']} "
             "(its default runner for this model: see its log), Weir from this commit.",
             f"Workload: {args.model} config, random weights, prompt and output lengths uniform in [100, 1024] "
             "(random.seed(0)), prompt tokens uniform in [0, 10000], temperature 0.6, ignore EOS, max_model_len 4096.",
             f"Command: `{command}`", "",
             f"| metric | Weir | vLLM {info['vllm']} | Weir / vLLM |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    (args.out_dir / f"race-{args.model}-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
