"""The race: Weir and vLLM on the same GPU in one run, nano-bench workloads (and a long-context one).

Usage (on a CUDA machine with Weir and vLLM 0.26.0 installed, the model's tokenizer.json built by
build_tokenizer.sh):
    python3 benchmarks/race.py OUT_DIR [--model qwen3-0.6b] [--sizes 256,1024] [--skip-vllm]
                               [--variant LABEL="WEIR OPTIONS" ...]
                               [--longctx [--longctx-requests 32] [--longctx-range 8192:16384,256:256]]
``--model`` names a folder of benchmarks/models (config + tokenizer; weights are random), or is a
path to a model folder (named by its last part).
``--sizes``: one nano-bench batch of each many requests, prompt and output lengths uniform in
[100, 1024], max_model_len 4096 (record ``<model>-nano`` for 256, ``<model>-<size>`` otherwise).
``--longctx`` adds the long-context decode workload, record ``<model>-longctx``: 32 requests in one
batch, prompt lengths uniform in [8192, 16384], 256 output tokens each, the same generator, seed
and sampling as nano; max_model_len is the longest prompt plus the longest output rounded up to
a multiple of 256 (16,640). vLLM runs all its workloads in one process, so with ``--longctx`` its
nano batches run at that max_model_len too (Weir's at 4096).
``--variant bf16-state="--linear-state-dtype bfloat16"`` also runs Weir with those options, as an
extra row and records of workload ``<workload>-bf16-state`` (the long-context one included).
Writes OUT_DIR/race-<model>-<date>.json and .md with both engines' figures and the Weir/vLLM
ratio, and OUT_DIR/latest-records-<model>.json in the benchmarks/results/latest.json record shape.
Stopped by SIGTERM (a ``timeout`` around it), it stops the engine run it started first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from weir.cli.bench.throughput import parse_random_range

HERE = Path(__file__).resolve().parent
# vLLM options a model needs on this machine (peers.md): flashinfer is absent, so Qwen3-Next's
# GDN prefill must use vLLM's Triton kernels; with its defaults vLLM 0.26 runs out of memory
# starting Kimi Linear 48B (CUDA-graph profiling for 1,024 sequences of KDA state).
VLLM_EXTRA = {"qwen3-next-24l": {"additional_config": {"gdn_prefill_backend": "triton"}},
              "kimi-linear-48b": {"max_num_seqs": 256, "max_num_batched_tokens": 4096}}
# vLLM's random weights fill norm weights with +-1e-3 as well (Weir's are 1), so the router's
# logits all but vanish; where routing adds a correction bias (DeepSeek's and Kimi's sigmoid
# routing) that bias alone then picks the experts, and every token of every step takes the same
# eight (deduced from its loader; its DeepSeek race figures bear it out): a decode step streams
# 8 experts' weights instead of nearly all 256, a fraction of what a trained model costs. vLLM's
# own routing simulator (what its MoE benchmarks use) spreads the tokens uniformly instead.
# Weir's random router spreads them a little less evenly, so its decode batches stream somewhat
# fewer experts than uniform routing would: profile_steps --expert-spread measures by how much,
# and the committed results say it beside the race.
UNIFORM_ROUTING = {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"}
VLLM_ENV = {name: UNIFORM_ROUTING for name in ("deepseek-v3-7l", "deepseek-v32-7l", "kimi-linear-48b")}
# The nano-bench workload's lengths and context; the long-context workload's defaults (its
# context is derived: longctx_max_model_len).
NANO_RANGE, NANO_MAX_MODEL_LEN = "100:1024,100:1024", 4096
LONGCTX_RANGE, LONGCTX_REQUESTS = "8192:16384,256:256", 32
# How long a stopped child gets to exit after SIGTERM before its process group is killed.
STOP_GRACE_SECONDS = 30


def has_tokenizer(model: Path) -> bool:
    """Folders that ship none (DeepSeek, Kimi Linear) run on token ids alone."""
    return (model / "tokenizer.json").is_file()


def longctx_max_model_len(text: str) -> int:
    """The longest prompt plus the longest output, rounded up to a multiple of 256 (16,640 for
    the default 8192:16384,256:256): both engines run the long-context workload at it."""
    (_, in_max), (_, out_max) = parse_random_range(text)
    return -(-(in_max + out_max) // 256) * 256


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM to the child's process group (vLLM runs its engine in a grandchild), SIGKILL to
    the group after ``grace`` seconds or once the child is gone (stragglers). A second SIGTERM to
    this script waits until that is done."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the whole group is gone
            pass
        proc.wait()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _unblock_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _read(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: int = 900) -> str:
    """``cmd``'s stdout; its stdout and stderr also go to ``log``. The child runs in its own process
    group, stopped with all it started however this returns (done, failed, timed out, SIGTERM)."""
    start = time.time()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # A SIGTERM landing inside Popen, once the child has started but before ``proc`` exists,
        # would leave that child running unstopped: it waits, blocked, until the ``try`` below
        # (the child unblocks it for itself before its exec).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **(env or {})},
                                    start_new_session=True, preexec_fn=_unblock_sigterm)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            raise
        status = "stopped"
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one pending is raised here
            proc.wait(timeout)
            status = f"rc={proc.returncode}, {time.time() - start:.0f} s"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout} s"
        except BaseException as error:  # SIGTERM (SystemExit from _exit_on_sigterm), Ctrl-C
            status = f"stopped by {type(error).__name__} after {time.time() - start:.0f} s"
            raise
        finally:
            stop_group(proc)
            # Whatever it printed, even when cut short: the log is the evidence.
            stdout, stderr = _read(out), _read(err)
            log.write_text(f"$ {' '.join(cmd)}\n[{status}]\n{stdout}\n--- stderr ---\n{stderr}")
    if status.startswith("timed out"):
        raise SystemExit(f"timed out: {' '.join(cmd)} (log {log})")
    if proc.returncode != 0:
        print(stdout[-3000:], stderr[-6000:], sep="\n")
        raise SystemExit(f"failed: {' '.join(cmd)} (log {log})")
    return stdout


def weir_throughput(model: Path, size: int, out_dir: Path, env: dict | None = None,
                    label: str = "", options: tuple[str, ...] = (), random_range: str = NANO_RANGE,
                    max_model_len: int = NANO_MAX_MODEL_LEN, workload: str | None = None) -> dict:
    """One ``weir bench throughput`` run of ``size`` requests; ``workload`` names its files
    (default: the size)."""
    name = f"weir-{model.name}-{workload or size}{'-' + label if label else ''}"
    result_file = out_dir / f"{name}.json"
    run([sys.executable, "-m", "weir.cli.main", "bench", "throughput", str(model), "--load-format", "dummy",
         "--num-prompts", str(size), "--random-range", random_range, "--temperature", "0.6",
         "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.9", "--seed", "0",
         *([] if has_tokenizer(model) else ["--skip-tokenizer-init"]),
         "--output-json", str(result_file), *options], out_dir / f"{name}.log", env=env)
    return json.loads(result_file.read_text())


def parse_vllm(stdout: str) -> tuple[float, dict[int, float], float | None]:
    """bench_vllm.py's start-up, nano rates by size and long-context rate (None if not run)."""
    startup = float(re.search(r"STARTUP ([\d.]+)s", stdout).group(1))
    rates = {int(m.group(1)): float(m.group(2))
             for m in re.finditer(r"RESULT vllm num_seqs=(\d+) .* out_tok/s=(\d+)", stdout)}
    longctx = re.search(r"RESULT vllm longctx num_seqs=\d+ .* out_tok/s=(\d+)", stdout)
    return startup, rates, float(longctx.group(1)) if longctx else None


def vllm_throughput(model: Path, sizes: list[int], out_dir: Path, longctx: tuple[int, str] | None = None
                    ) -> tuple[float, dict[int, float], float | None]:
    """vLLM's start-up, its nano rates and its long-context rate (``longctx``: requests, range),
    all from one process: with ``longctx`` it runs at the long-context max_model_len."""
    extra = {**VLLM_EXTRA.get(model.name, {}), **({} if has_tokenizer(model) else {"skip_tokenizer_init": True})}
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_EXTRA": json.dumps(extra), **VLLM_ENV.get(model.name, {})}
    cmd = [sys.executable, str(HERE / "peers" / "bench_vllm.py"), str(model), ",".join(map(str, sizes)),
           "--random-range", NANO_RANGE]
    if longctx:
        requests, random_range = longctx
        cmd += ["--max-model-len", str(max(NANO_MAX_MODEL_LEN, longctx_max_model_len(random_range))),
                "--longctx", str(requests), "--longctx-range", random_range]
    else:
        cmd += ["--max-model-len", str(NANO_MAX_MODEL_LEN)]
    stdout = run(cmd, out_dir / f"vllm-{model.name}.log", env=env, timeout=1800 if longctx else 900)
    startup, rates, longctx_rate = parse_vllm(stdout)
    if longctx and longctx_rate is None:
        raise SystemExit(f"no long-context RESULT line in {out_dir / f'vllm-{model.name}.log'}")
    return startup, rates, longctx_rate


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


def _exit_on_sigterm(signum, frame) -> None:
    # A `timeout` around this script sends SIGTERM: exit through run()'s `finally`, which stops the
    # engine run under way, or its process keeps the GPU's memory after this script is gone.
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Weir against vLLM on one GPU: nano-bench and long-context batches")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default="qwen3-0.6b",
                        help="a folder of benchmarks/models, or a path to a model folder (named by its last part)")
    parser.add_argument("--sizes", default="256,1024", help="requests of each nano-bench batch")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--variant", action="append", default=[], metavar='LABEL="OPTIONS"',
                        help="also run Weir with these extra bench options, recorded as <workload>-LABEL")
    parser.add_argument("--longctx", action="store_true",
                        help=f"also the long-context decode workload, recorded as <model>-longctx: "
                             f"{LONGCTX_REQUESTS} requests, lengths {LONGCTX_RANGE}")
    parser.add_argument("--longctx-requests", type=int, metavar="N",
                        help=f"requests of the long-context batch (default {LONGCTX_REQUESTS})")
    parser.add_argument("--longctx-range", metavar="IMIN:IMAX,OMIN:OMAX",
                        help=f"its prompt and output lengths (default {LONGCTX_RANGE}); max_model_len "
                             "is IMAX + OMAX rounded up to a multiple of 256")
    args = parser.parse_args(argv)
    args.variants = []
    for item in args.variant:
        label, _, options = item.partition("=")
        if not re.fullmatch(r"[\w.-]+", label) or not options or label in dict(args.variants):
            parser.error(f"--variant {item!r}: want a distinct LABEL (letters, digits, . _ -)=\"OPTIONS\"")
        args.variants.append((label, tuple(shlex.split(options))))
    try:
        args.size_list = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: want request counts, e.g. 256,1024")
    if not args.longctx and (args.longctx_requests is not None or args.longctx_range is not None):
        parser.error("--longctx-requests and --longctx-range need --longctx")
    if args.longctx_requests is not None and args.longctx_requests < 1:
        parser.error(f"--longctx-requests {args.longctx_requests}: want at least 1")
    if args.longctx_range is not None:
        try:
            parse_random_range(args.longctx_range)
        except ValueError:
            parser.error(f"--longctx-range {args.longctx_range!r}: want IMIN:IMAX,OMIN:OMAX with 1 <= min <= max")
    return args


def reproducing_command(args: argparse.Namespace) -> str:
    command = f"python3 benchmarks/race.py OUT --model {args.model} --sizes {args.sizes}"
    command += "".join(f" --variant {shlex.quote(item)}" for item in args.variant)
    if args.longctx:
        command += " --longctx"
        command += f" --longctx-requests {args.longctx_requests}" if args.longctx_requests is not None else ""
        command += f" --longctx-range {args.longctx_range}" if args.longctx_range is not None else ""
    return command + (" --skip-vllm" if args.skip_vllm else "")


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    variants, sizes = args.variants, args.size_list
    longctx = None  # (requests, range, max_model_len) of the long-context workload, if run
    if args.longctx:
        longctx_range = args.longctx_range or LONGCTX_RANGE
        longctx = (args.longctx_requests or LONGCTX_REQUESTS, longctx_range, longctx_max_model_len(longctx_range))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    info = versions()

    # Relative to the working folder: the results record it, and the machine's paths say nothing.
    model = Path(os.path.relpath(HERE / "models" / args.model))
    name = Path(args.model).name  # of records and files: the folder's name
    weir = {}
    # One Triton cache for every Weir run, empty at first: the first run's start-up (the one
    # reported) compiles and autotunes everything; later runs find it all there.
    triton_cache = {"TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="weir-race-triton-")}

    def weir_longctx(label: str = "", options: tuple[str, ...] = ()) -> dict:
        requests, random_range, max_model_len = longctx
        result = weir_throughput(model, requests, args.out_dir, env=triton_cache, label=label, options=options,
                                 random_range=random_range, max_model_len=max_model_len, workload="longctx")
        print(f"weir {label + ' ' if label else ''}{name} long context, {requests} requests: "
              f"{result['output_tokens_per_second']:,.0f} out tok/s", flush=True)
        return result

    try:
        for size in sizes:  # printed at once: a later timeout must not lose them
            weir[size] = weir_throughput(model, size, args.out_dir, env=triton_cache)
            print(f"weir {name} {size} requests: {weir[size]['output_tokens_per_second']:,.0f} out tok/s, "
                  f"start-up {weir[size]['startup_seconds']:.1f} s", flush=True)
        weir_long = weir_longctx() if longctx else None
        variant_runs = {}  # (label, size or "longctx") -> result
        for label, options in variants:
            for size in sizes:
                variant_runs[label, size] = weir_throughput(model, size, args.out_dir, env=triton_cache, label=label,
                                                            options=options)
                print(f"weir {label} {name} {size} requests: "
                      f"{variant_runs[label, size]['output_tokens_per_second']:,.0f} out tok/s", flush=True)
            if longctx:
                variant_runs[label, "longctx"] = weir_longctx(label, options)
    finally:
        shutil.rmtree(triton_cache["TRITON_CACHE_DIR"], ignore_errors=True)
    vllm_startup, vllm_rates, vllm_long = (None, {}, None) if args.skip_vllm else vllm_throughput(
        model, sizes, args.out_dir, longctx=longctx[:2] if longctx else None)

    # The peer is named by the version that ran, not by the one this script was written against.
    peer_name = None if args.skip_vllm else f"vllm-{info['vllm'] or 'unknown'}"
    records, rows = [], []
    results = {**{("", size): weir[size] for size in sizes}, **variant_runs}  # (label, size or "longctx")
    if longctx:
        results["", "longctx"] = weir_long
        requests, longctx_range, _ = longctx
        (in_min, in_max), (out_min, out_max) = parse_random_range(longctx_range)
        outputs = f"{out_min:,}" if out_min == out_max else f"{out_min:,}-{out_max:,}"
        long_row = f"long context: {requests} requests, {in_min:,}-{in_max:,} prompt + {outputs} output tokens"
    runs = []  # (label, workload, row's name, Weir's result, vLLM's rate)
    for label in ["", *(label for label, _ in variants)]:
        runs += [(label, f"{name}-nano" if size == 256 else f"{name}-{size}", f"{size} requests",
                  results[label, size], vllm_rates.get(size)) for size in sizes]
        if longctx:
            runs.append((label, f"{name}-longctx", long_row, results[label, "longctx"], vllm_long))
    for label, workload, row, result, peer in runs:
        ours = result["output_tokens_per_second"]
        records.append({"workload": workload + (f"-{label}" if label else ""), "metric": "output_tokens_per_second",
                        "weir": round(ours, 1), "peer": peer_name, "peer_value": peer,
                        "ratio": round(ours / peer, 3) if peer else None, "date": date, "device": info["gpu"]})
        rows.append((f"{row}, output tok/s{f' ({label})' if label else ''}", f"{ours:,.0f}",
                     f"{peer:,.0f}" if peer else "-", f"{ours / peer:.2f}" if peer else "-"))
    weir_startup = weir[sizes[0]]["startup_seconds"]
    records.append({"workload": f"startup-{name}", "metric": "startup_seconds", "weir": round(weir_startup, 1),
                    "peer": peer_name, "peer_value": vllm_startup,
                    "ratio": round(weir_startup / vllm_startup, 3) if vllm_startup else None,
                    "date": date, "device": info["gpu"]})
    rows.append(("start-up to ready, s", f"{weir_startup:.1f}", f"{vllm_startup:.1f}" if vllm_startup else "-",
                 f"{weir_startup / vllm_startup:.2f}" if vllm_startup else "-"))

    command = reproducing_command(args)
    report = {"date": date, "versions": info, "command": command, "weir": weir,
              "weir_variants": {f"{label}-{size}": result for (label, size), result in variant_runs.items()},
              "vllm": {"startup_seconds": vllm_startup, "output_tokens_per_second": vllm_rates,
                       "env": None if args.skip_vllm else VLLM_ENV.get(name, {})},
              "records": records}
    if longctx:
        report["longctx"] = {"num_requests": longctx[0], "random_range": longctx[1], "max_model_len": longctx[2]}
        report["weir_longctx"] = weir_long
        report["vllm"]["longctx_output_tokens_per_second"] = vllm_long
    (args.out_dir / f"race-{name}-{date}.json").write_text(json.dumps(report, indent=2))
    (args.out_dir / f"latest-records-{name}.json").write_text(json.dumps(records, indent=2))
    lines = [f"# {name} nano-bench race, {date}", "",
             f"{info['gpu']}; torch {info['torch']}, triton {info['triton']}, vLLM {info['vllm']} "
             "(its default runner for this model: see its log), Weir from this commit.",
             f"Workload: {name} config, random weights, prompt and output lengths uniform in [100, 1024] "
             "(random.seed(0)), prompt tokens uniform in [0, 10000], temperature 0.6, ignore EOS, max_model_len 4096."]
    if longctx:
        lines.append(
            f"Long-context workload: {requests} requests in one batch, prompt lengths uniform in [{in_min}, {in_max}], "
            f"output lengths uniform in [{out_min}, {out_max}], drawn the same way (random.seed(0)), "
            f"max_model_len {longctx[2]} for both engines"
            + ("." if args.skip_vllm else f"; vLLM runs all its workloads in one process, so its nano-bench "
               f"batches ran at max_model_len {max(NANO_MAX_MODEL_LEN, longctx[2])} too."))
    if not args.skip_vllm and name in VLLM_ENV:
        lines.append(f"vLLM's environment: {' '.join(f'{key}={value}' for key, value in VLLM_ENV[name].items())} "
                     "(its random weights would route every token to the same experts: see VLLM_ENV in race.py).")
    lines += [f"Command: `{command}`", "",
              f"| metric | Weir | vLLM {info['vllm']} | Weir / vLLM |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    (args.out_dir / f"race-{name}-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
