"""The serving race: `weir serve` and `vllm serve` on one machine, one after the other, driven by
the same `weir bench serve` client at several request rates.

Usage (Weir and vLLM installed in this Python):
    python3 benchmarks/serve_race.py OUT_DIR --model benchmarks/models/qwen3-0.6b [--model DIR ...]
        [--rates 4,16,inf] [--tokenizer DIR] [--max-model-len 4096] [--engines weir,vllm]
For each model folder and engine: start the server (random weights, `--load-format dummy`) on a
free port, wait for /health, send a short warm-up, then one `bench serve` run per rate (1024-token
random prompts, 256 output tokens, --ignore-eos; max(200, 20 x rate) prompts, a fixed number at
inf), then stop it. Each run draws prompts of its own (seed + 1 + the rate's index; the warm-up
uses the seed), the same for both engines: no run finds an earlier run's prompts in the prefix
cache. Writes OUT_DIR/<engine>-<model>-rate<R>.json (bench results),
<engine>-<model>-server.log and .json (the server's log, version and command), and from all of
those OUT_DIR/serve-race.md, serve-race.json and latest-records-serve.json (records in
benchmarks/results/latest.json's shape: workload serve-<model>-rate<R>, ratio = Weir / vLLM).
``--report-only`` rebuilds the three reports from the files already in OUT_DIR, so engines or
models run in separate calls make one report.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ENGINES = ("weir", "vllm")
# Bench result keys in the race, as vLLM's bench names them: (key, column title, format).
RACE_METRICS = (
    ("output_throughput", "output tok/s", "{:,.0f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:,.1f}"),
    ("median_ttft_ms", "median TTFT ms", "{:,.1f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:,.1f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.2f}"),
    ("median_tpot_ms", "median TPOT ms", "{:.2f}"),
    ("p99_tpot_ms", "p99 TPOT ms", "{:.2f}"),
)
# Record metric names where latest.json already has a name for the figure.
RECORD_NAMES = {"output_throughput": "output_tokens_per_second"}
# The target: Weir at or below vLLM on these, at every rate.
TARGET_METRICS = ("p99_ttft_ms", "mean_tpot_ms")


def parse_rates(text: str) -> list[float]:
    """``4,16,inf`` -> [4.0, 16.0, inf]; each a positive number of requests/s or inf."""
    rates = []
    for item in text.split(","):
        try:
            rate = float(item)
        except ValueError:
            rate = math.nan
        if math.isnan(rate) or rate <= 0:
            raise argparse.ArgumentTypeError(f"--rates wants positive numbers or inf, comma-separated; got {item!r}")
        rates.append(rate)
    return rates


def rate_label(rate: float) -> str:
    """``4``, ``0.5``, ``inf``: how a rate appears in workload and file names."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def num_prompts_for(rate: float, args: argparse.Namespace) -> int:
    """Enough requests for a p99 at each rate (at least ``min_prompts``, ``prompts_per_rate``
    seconds of arrivals), bounded in time at inf."""
    if args.num_prompts is not None:
        return args.num_prompts
    if math.isinf(rate):
        return args.inf_prompts
    return max(args.min_prompts, math.ceil(args.prompts_per_rate * rate))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read() or b"null") if response.status == 200 else None


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no torch here: the report says so
        return "unknown"


def server_command(engine: str, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    if engine == "weir":
        launcher = [sys.executable, "-m", "weir.cli.main", "serve"]
        extra = shlex.split(args.weir_args)
    else:
        if args.vllm_command:
            launcher = shlex.split(args.vllm_command)
        elif importlib.util.find_spec("vllm") is not None:
            launcher = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
        elif shutil.which("vllm"):
            launcher = ["vllm", "serve"]
        else:
            raise RuntimeError("vLLM is not installed here (no vllm module, no vllm command); "
                               "pass --engines weir to race Weir alone")
        extra = shlex.split(args.vllm_args)
    command = [*launcher, str(model), "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
               "--max-model-len", str(args.max_model_len), "--served-model-name", model.name]
    if args.tokenizer:
        command += ["--tokenizer", str(args.tokenizer)]
    return command + extra


class Server:
    """One server process in its own process group, its output in ``log_path``."""

    def __init__(self, command: list[str], log_path: Path, env: dict[str, str]):
        self.port = int(command[command.index("--port") + 1])
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._log.write(f"$ {shlex.join(command)}\n")
        self._log.flush()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **env}, start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} before it was ready "
                                   f"(log {self.log_path}):\n{self.log_path.read_text()[-3000:]}")
            try:
                get_json(self.base_url + "/health")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {timeout:.0f} s (log {self.log_path})")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the whole group (vLLM runs its engine in a child process), then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                continue
        self._log.close()


def run_bench(server: Server, num_prompts: int, rate: float, output_len: int, args: argparse.Namespace,
              log_path: Path, result_name: str | None, seed: int) -> None:
    command = [sys.executable, "-m", "weir.cli.main", "bench", "serve", "--base-url", server.base_url,
               "--num-prompts", str(num_prompts), "--request-rate", rate_label(rate),
               "--random-input-len", str(args.input_len), "--random-output-len", str(output_len),
               "--ignore-eos", "--seed", str(seed), *shlex.split(args.bench_args)]
    if result_name is not None:
        command += ["--save-result", "--result-dir", str(args.out_dir), "--result-filename", result_name]
        if importlib.util.find_spec("matplotlib") is None:
            command.append("--no-plot")
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve failed with {proc.returncode} (log {log_path}):\n"
                           f"{log_path.read_text()[-2000:]}")


def run_seed(seed: int, rate_index: int) -> int:
    """The prompts' seed of the run at the ``rate_index``-th rate: one of its own, so that no run
    hits the prefix cache with the prompts of the warm-up or of an earlier run."""
    return seed + 1 + rate_index


def shown_command(command: list[str]) -> str:
    """The command as a reader reruns it: ``python3`` and paths relative to the working folder, not
    this machine's interpreter and checkout."""
    here = Path.cwd()

    def shown(part: str) -> str:
        if part == sys.executable:
            return "python3"
        path = Path(part)
        return str(path.relative_to(here)) if path.is_absolute() and path.is_relative_to(here) else part

    return shlex.join(shown(part) for part in command)


def race_engine(engine: str, model: Path, rates: list[float], args: argparse.Namespace) -> list[str]:
    """Serve ``model`` with ``engine`` and bench it at every rate; returns the failures."""
    stem = f"{engine}-{model.name}"
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"} if engine == "vllm" else {}
    command = server_command(engine, model, free_port(), args)
    server = Server(command, args.out_dir / f"{stem}-server.log", env)
    failures = []
    try:
        started = time.monotonic()
        server.wait_ready(args.startup_timeout)
        startup = time.monotonic() - started
        info = {"engine": engine, "version": (get_json(server.base_url + "/version") or {}).get("version"),
                "command": shown_command(command), "startup_seconds": round(startup, 1), "device": device_name()}
        (args.out_dir / f"{stem}-server.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"{stem}: ready in {startup:.0f} s (version {info['version']})", flush=True)
        if args.warmup_prompts:
            run_bench(server, args.warmup_prompts, math.inf, 16, args, args.out_dir / f"{stem}-warmup.log", None,
                      args.seed)
        for index, rate in enumerate(rates):
            name = f"{stem}-rate{rate_label(rate)}"
            try:
                run_bench(server, num_prompts_for(rate, args), rate, args.output_len, args,
                          args.out_dir / f"{name}.log", f"{name}.json", run_seed(args.seed, index))
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                failures.append(f"{name}: {error}")
                print(f"FAILED {name}: {error}", flush=True)
                continue
            result = json.loads((args.out_dir / f"{name}.json").read_text())
            print(f"{name}: {result['output_throughput']:,.0f} out tok/s, p99 TTFT {result['p99_ttft_ms']:.1f} ms, "
                  f"mean TPOT {result['mean_tpot_ms']:.2f} ms", flush=True)
    except RuntimeError as error:
        failures.append(f"{stem}: {error}")
        print(f"FAILED {stem}: {error}", flush=True)
    finally:
        server.stop()
    return failures


def load_runs(out_dir: Path, models: list[str], rates: list[float]) -> tuple[dict, dict]:
    """``({(engine, model, rate label): bench result}, {(engine, model): server info})`` from the
    files in ``out_dir``; runs that left no file are absent."""
    runs, servers = {}, {}
    for model in models:
        for engine in ENGINES:
            info = out_dir / f"{engine}-{model}-server.json"
            if info.exists():
                servers[engine, model] = json.loads(info.read_text())
            for rate in rates:
                result = out_dir / f"{engine}-{model}-rate{rate_label(rate)}.json"
                if result.exists():
                    runs[engine, model, rate_label(rate)] = json.loads(result.read_text())
    return runs, servers


def _ratio(ours, peer) -> float | None:
    return round(ours / peer, 3) if ours is not None and peer else None


def build_records(runs: dict, servers: dict, models: list[str], rates: list[float], date: str) -> list[dict]:
    """One latest.json record per model, rate and race metric that Weir ran."""
    records = []
    for model in models:
        weir_info = servers.get(("weir", model), {})
        peer_name = f"vllm-{servers.get(('vllm', model), {}).get('version') or 'unknown'}"
        for rate in rates:
            ours, peer = runs.get(("weir", model, rate_label(rate))), runs.get(("vllm", model, rate_label(rate)))
            if ours is None:
                continue
            for key, _, _ in RACE_METRICS:
                value, peer_value = round(ours[key], 2), round(peer[key], 2) if peer else None
                records.append({"workload": f"serve-{model}-rate{rate_label(rate)}",
                                "metric": RECORD_NAMES.get(key, key), "weir": value, "peer": peer_name if peer else None,
                                "peer_value": peer_value, "ratio": _ratio(value, peer_value), "date": date,
                                "device": weir_info.get("device", "unknown")})
    return records


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def model_table(model: str, runs: dict, servers: dict, rates: list[float]) -> list[str]:
    vllm_version = servers.get(("vllm", model), {}).get("version")
    header = ["rate (req/s)", "prompts", "engine"] + [title for _, title, _ in RACE_METRICS]
    lines = [f"## {model}", "", _row(header), _row(["---"] * len(header))]
    missed = []
    for rate in rates:
        label = rate_label(rate)
        pair = {engine: runs.get((engine, model, label)) for engine in ENGINES}
        for engine, name in (("weir", "Weir"), ("vllm", f"vLLM {vllm_version or ''}".strip())):
            result = pair[engine]
            if result is None:
                lines.append(_row([label, "-", name] + ["not run"] + ["-"] * (len(RACE_METRICS) - 1)))
                continue
            failed = f" ({result['failed']} failed)" if result.get("failed") else ""
            lines.append(_row([label, f"{result['num_prompts']}{failed}", name]
                              + [fmt.format(result[key]) for key, _, fmt in RACE_METRICS]))
        if pair["weir"] and pair["vllm"]:
            ratios = [_ratio(pair["weir"][key], pair["vllm"][key]) for key, _, _ in RACE_METRICS]
            lines.append(_row([label, "", "Weir / vLLM"] + [f"{r:.2f}" if r is not None else "-" for r in ratios]))
            missed += [f"{key} {r:.2f}x at rate {label}" for (key, _, _), r in zip(RACE_METRICS, ratios)
                       if key in TARGET_METRICS and r is not None and r > 1]
    compared = any(runs.get(("weir", model, rate_label(r))) and runs.get(("vllm", model, rate_label(r)))
                   for r in rates)
    if compared:
        verdict = "met at every rate compared" if not missed else "missed: " + ", ".join(missed)
        lines += ["", f"Target (Weir's p99 TTFT and mean TPOT at or below vLLM's): {verdict}."]
    startups = [f"{engine} {servers[engine, model]['startup_seconds']:.0f} s" for engine in ENGINES
                if (engine, model) in servers]
    if startups:
        lines.append(f"Server start-up to /health ready: {', '.join(startups)}.")
    return lines + [""]


def write_reports(args: argparse.Namespace, rates: list[float], failures: list[str]) -> None:
    models = [model.name for model in args.model]
    runs, servers = load_runs(args.out_dir, models, rates)
    date = datetime.date.today().isoformat()
    records = build_records(runs, servers, models, rates, date)
    versions = {engine: sorted({info.get("version") or "unknown" for (e, _), info in servers.items() if e == engine})
                for engine in ENGINES}
    devices = sorted({info.get("device", "unknown") for info in servers.values()}) or ["unknown"]
    # Every workload option that differs from its default, so the command reruns this race.
    workload_options = [f"--{name.replace('_', '-')}={shlex.quote(str(value))}"
                        for name, value in vars(args).items() if name in WORKLOAD_DEFAULTS
                        and value != WORKLOAD_DEFAULTS[name]]
    command = "python3 benchmarks/serve_race.py OUT " + " ".join(
        [shlex.join(arg for model in args.model for arg in ("--model", str(model))),
         "--rates", ",".join(rate_label(r) for r in rates), "--max-model-len", str(args.max_model_len),
         *workload_options])
    prompt_kind = " (words)" if "--text" in shlex.split(args.bench_args) else " (token ids)"
    lines = [f"# Serving race, {date}", "",
             f"{', '.join(devices)}; Weir {', '.join(versions['weir']) or '-'}, "
             f"vLLM {', '.join(versions['vllm']) or '-'}; "
             "one server at a time, the same `weir bench serve` client for both.",
             f"Workload: random weights (`--load-format dummy`), max_model_len {args.max_model_len}, "
             f"{args.input_len}-token random prompts{prompt_kind}, {args.output_len} output tokens, --ignore-eos, "
             f"seed {args.seed} (each rate's run seed + 1 + its index: no run hits the prefix cache with an earlier "
             f"run's prompts), Poisson arrivals; {args.warmup_prompts} warm-up requests per server first"
             f"{f'; bench options `{args.bench_args}`' if args.bench_args else ''}. "
             "TTFT and TPOT as vLLM's bench defines them (TPOT excludes the first token).",
             f"Command: `{command}`", ""]
    for model in models:
        lines += model_table(model, runs, servers, rates)
    if failures:
        lines += ["Failures:", ""] + [f"- {failure.splitlines()[0]}" for failure in failures] + [""]
    report = {"date": date, "command": command, "devices": devices, "versions": versions,
              "workload": {"max_model_len": args.max_model_len, "input_len": args.input_len,
                           "output_len": args.output_len, "seed": args.seed, "warmup_prompts": args.warmup_prompts,
                           "rates": [rate_label(r) for r in rates]},
              "servers": {f"{engine}-{model}": info for (engine, model), info in servers.items()},
              "runs": {f"{engine}-{model}-rate{label}": {key: result.get(key) for key in
                                                        ("num_prompts", "completed", "failed", "duration",
                                                         *(k for k, _, _ in RACE_METRICS))}
                       for (engine, model, label), result in runs.items()},
              "records": records, "failures": failures}
    (args.out_dir / "serve-race.md").write_text("\n".join(lines))
    (args.out_dir / "serve-race.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out_dir / "latest-records-serve.json").write_text(json.dumps(records, indent=2) + "\n")
    print("\n".join(lines))


# What the runs' workload depends on beside models, rates and max_model_len, with the defaults
# parse_args gives them: the report's command names those that were changed.
WORKLOAD_DEFAULTS = {"input_len": 1024, "output_len": 256, "seed": 0, "num_prompts": None, "min_prompts": 200,
                     "prompts_per_rate": 20.0, "inf_prompts": 400, "warmup_prompts": 16, "weir_args": "",
                     "vllm_args": "", "bench_args": "", "tokenizer": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", type=Path, action="append", required=True,
                        help="a model folder (config.json; weights are random); repeat for several")
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("4,16,inf"),
                        help="request rates, requests/s or inf, comma-separated (default 4,16,inf)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder for both servers (default: the model's)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--input-len", type=int, default=WORKLOAD_DEFAULTS["input_len"])
    parser.add_argument("--output-len", type=int, default=WORKLOAD_DEFAULTS["output_len"])
    parser.add_argument("--seed", type=int, default=WORKLOAD_DEFAULTS["seed"])
    parser.add_argument("--num-prompts", type=int, help="requests per run at every rate (default: by rate)")
    parser.add_argument("--min-prompts", type=int, default=WORKLOAD_DEFAULTS["min_prompts"])
    parser.add_argument("--prompts-per-rate", type=float, default=WORKLOAD_DEFAULTS["prompts_per_rate"],
                        help="at a finite rate: this many seconds of arrivals, if more than --min-prompts")
    parser.add_argument("--inf-prompts", type=int, default=WORKLOAD_DEFAULTS["inf_prompts"],
                        help="requests of the run at rate inf")
    parser.add_argument("--warmup-prompts", type=int, default=WORKLOAD_DEFAULTS["warmup_prompts"],
                        help="short requests before the runs (0: none)")
    parser.add_argument("--engines", default="weir,vllm", help="which servers to run: weir, vllm or both")
    parser.add_argument("--weir-args", default="", help="extra `weir serve` options")
    parser.add_argument("--vllm-args", default="", help="extra `vllm serve` options")
    parser.add_argument("--bench-args", default="", help="extra `weir bench serve` options for every run")
    parser.add_argument("--vllm-command", help="what starts vLLM's server, before its model argument "
                                               "(default: python -m vllm.entrypoints.cli.main serve, or vllm serve)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to be ready")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds one bench run may take")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild the reports from the results already in OUT_DIR")
    args = parser.parse_args(argv)
    engines = [engine.strip() for engine in args.engines.split(",") if engine.strip()]
    if not engines or any(engine not in ENGINES for engine in engines) or len(set(engines)) != len(engines):
        parser.error(f"--engines wants weir, vllm or both, comma-separated; got {args.engines!r}")
    args.engines = engines
    if len({model.name for model in args.model}) != len(args.model):
        parser.error("two --model folders have the same name; results are filed by folder name")
    for name in ("max_model_len", "input_len", "output_len", "min_prompts", "inf_prompts"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.num_prompts is not None and args.num_prompts <= 0:
        parser.error("--num-prompts must be positive")
    if args.warmup_prompts < 0:
        parser.error("--warmup-prompts must be 0 or more")
    if args.input_len + args.output_len > args.max_model_len:
        parser.error(f"--input-len {args.input_len} + --output-len {args.output_len} exceed "
                     f"--max-model-len {args.max_model_len}")
    if not args.report_only:
        for model in args.model:
            if not (model / "config.json").is_file():
                parser.error(f"--model {model}: no config.json in that folder")
        if args.tokenizer is not None and not args.tokenizer.is_dir():
            parser.error(f"--tokenizer {args.tokenizer} is not a folder")
    return args


def _exit_on_sigterm(signum, frame) -> None:
    # A `timeout` around this script sends SIGTERM: exit through the `finally` that stops the
    # server, or its engine process keeps the GPU's memory after this script is gone.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    if not args.report_only:
        for model in args.model:
            for engine in args.engines:
                failures += race_engine(engine, model.absolute(), args.rates, args)  # keeps its name
    write_reports(args, args.rates, failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
