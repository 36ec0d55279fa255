"""``benchmarks/race.py`` and ``benchmarks/peers/bench_vllm.py`` on the CPU: the same prompts for
both engines, the options, the vLLM output it reads, a whole race of ``weir bench throughput`` on
the tiny model against a fake ``vllm`` package, and a race stopped by SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers_models import TINY_VOCAB_SIZE, make_tiny_llama
from helpers_processes import HAS_PROC, assert_all_gone, processes_naming

ROOT = Path(__file__).resolve().parents[1]
RACE = ROOT / "benchmarks" / "race.py"

# What bench_vllm.py needs of vLLM, writing what it was given to $FAKE_VLLM_LOG (JSON lines);
# with $FAKE_VLLM_HANG it starts a child (vLLM's engine process) and never finishes a batch.
FAKE_VLLM = '''
import json, os, subprocess, sys, time

__version__ = "0.0.0-fake"


class SamplingParams:
    def __init__(self, **options):
        self.options = options


class LLM:
    def __init__(self, model, **options):
        self._write({"model": model, "options": options})
        hang = os.environ.get("FAKE_VLLM_HANG")
        if hang:
            self.engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", hang])

    def _write(self, entry):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
            log.write(json.dumps(entry) + "\\n")

    def generate(self, prompts, params, use_tqdm=True):
        if os.environ.get("FAKE_VLLM_HANG"):
            time.sleep(600)
        params = params if isinstance(params, list) else [params] * len(prompts)
        self._write({"prompts": [p["prompt_token_ids"] for p in prompts], "params": [p.options for p in params]})
        time.sleep(0.01)
        return []
'''


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def race():
    return _load("race", RACE)


@pytest.fixture(scope="module")
def bench_vllm():
    return _load("bench_vllm", ROOT / "benchmarks" / "peers" / "bench_vllm.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny Llama with room for the nano-bench context (max_model_len 4096)."""
    folder = tmp_path_factory.mktemp("race") / "tiny-race"
    folder.mkdir()
    return make_tiny_llama(folder, with_tokenizer=True, max_position_embeddings=4096)


@pytest.fixture
def fake_vllm(tmp_path):
    """PYTHONPATH and log of a fake ``vllm`` package."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "fake-vllm.jsonl"
    path = os.pathsep.join([str(tmp_path / "fake"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": path, "FAKE_VLLM_LOG": str(log)}, log


@pytest.mark.parametrize("name, uniform", [("deepseek-v32-7l", True), ("deepseek-v3-7l", True),
                                            ("kimi-linear-48b", True), ("qwen3-next-24l", False)])
def test_vllm_routes_uniformly_where_its_random_weights_would_not(race, monkeypatch, tmp_path, name, uniform):
    """Correction-bias routing (DeepSeek, Kimi) runs vLLM under its uniform routing simulator."""
    seen = {}

    def fake_run(cmd, log, env=None, timeout=900):
        seen.update(env)
        return "STARTUP 1.0s\nRESULT vllm num_seqs=256 prompts out_tok/s=5\n"

    monkeypatch.setattr(race, "run", fake_run)
    assert race.vllm_throughput(tmp_path / name, [256], tmp_path) == (1.0, {256: 5.0}, None)
    assert (seen.get("VLLM_MOE_ROUTING_SIMULATION_STRATEGY") == "uniform_random") is uniform
    assert json.loads(seen["VLLM_EXTRA"])["skip_tokenizer_init"] is True  # the folder has no tokenizer.json


@pytest.mark.parametrize("text", ["100:1024,100:1024", "8192:16384,256:256", "3:9,1:4"])
@pytest.mark.parametrize("vocab_size", [129280, TINY_VOCAB_SIZE])
def test_vllm_draws_the_prompts_weir_bench_draws(bench_vllm, tmp_path, text, vocab_size):
    from weir.cli.bench.throughput import parse_random_range, random_workload

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    bound = bench_vllm.token_id_bound(str(tmp_path))
    assert bound == min(10000, vocab_size - 1)  # weir.cli.bench.common.token_id_bound
    ranges = parse_random_range(text)
    assert bench_vllm.parse_range(text) == ranges
    num = 32 if text.startswith("8192") else 64
    assert bench_vllm.workload(num, input_range=ranges[0], output_range=ranges[1], max_token_id=bound) == \
        random_workload(num, *ranges, seed=0, max_token_id=bound)


def test_the_nano_prompts_are_the_ones_vllm_always_ran(bench_vllm):
    prompts, outs = bench_vllm.workload(256)  # the race's records so far: 142,827 + 133,966 tokens
    assert (sum(map(len, prompts)), sum(outs)) == (142827, 133966)


def test_race_reads_what_bench_vllm_prints(race, bench_vllm):
    prompts, outs = bench_vllm.workload(3)
    long_prompts, long_outs = bench_vllm.workload(2, input_range=(50, 60), output_range=(5, 5))
    stdout = "\n".join(["INFO noise", "STARTUP 12.5s", bench_vllm.result_line("", prompts, outs, 2.0),
                        bench_vllm.result_line("longctx", long_prompts, long_outs, 0.5)])
    assert race.parse_vllm(stdout) == (12.5, {3: float(round(sum(outs) / 2.0))}, float(round(10 / 0.5)))
    assert race.parse_vllm(stdout.rsplit("\n", 1)[0]) == (12.5, {3: float(round(sum(outs) / 2.0))}, None)


def test_options(race, tmp_path):
    assert race.longctx_max_model_len(race.LONGCTX_RANGE) == 16640
    assert race.longctx_max_model_len("300:600,8:8") == 768
    args = race.parse_args([str(tmp_path), "--model", "deepseek-v32-7l", "--sizes", "256", "--longctx"])
    assert args.size_list == [256] and args.longctx and args.longctx_range is None
    assert race.reproducing_command(args) == ("python3 benchmarks/race.py OUT --model deepseek-v32-7l --sizes 256 "
                                              "--longctx")
    args = race.parse_args([str(tmp_path), "--longctx", "--longctx-requests", "4", "--longctx-range", "10:20,3:3",
                            "--variant", "x=--max-num-seqs 2", "--skip-vllm"])
    assert race.reproducing_command(args) == ("python3 benchmarks/race.py OUT --model qwen3-0.6b --sizes 256,1024 "
                                              "--variant 'x=--max-num-seqs 2' --longctx --longctx-requests 4 "
                                              "--longctx-range 10:20,3:3 --skip-vllm")


@pytest.mark.parametrize("options, message", [
    (["--longctx-range", "10:20,3:3"], "need --longctx"),
    (["--longctx", "--longctx-range", "20:10,3:3"], "--longctx-range"),
    (["--longctx", "--longctx-requests", "0"], "want at least 1"),
    (["--sizes", "many"], "--sizes"),
    (["--variant", "no-options"], "--variant"),
])
def test_bad_options_are_named(race, tmp_path, capsys, options, message):
    with pytest.raises(SystemExit):
        race.parse_args([str(tmp_path), *options])
    assert message in capsys.readouterr().err


@pytest.mark.integration
def test_race_on_the_tiny_model_against_a_fake_vllm(tiny_model, fake_vllm, tmp_path):
    """The whole run on the CPU: Weir's nano and long-context batches (and a variant's), the fake
    vLLM's in one process, records, report and the command that reruns it."""
    from weir.cli.bench.throughput import random_workload

    env, log = fake_vllm
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(RACE), str(out), "--model", str(tiny_model), "--sizes", "1", "--longctx",
                    "--longctx-requests", "2", "--longctx-range", "300:600,8:8", "--variant", "few=--max-num-seqs 2"],
                   env={**os.environ, **env}, check=True, cwd=ROOT, timeout=600)
    report = json.loads(next(out.glob("race-tiny-race-*.json")).read_text())
    records = {r["workload"]: r for r in report["records"]}
    assert list(records) == ["tiny-race-1", "tiny-race-longctx", "tiny-race-1-few", "tiny-race-longctx-few",
                             "startup-tiny-race"]
    assert json.loads((out / "latest-records-tiny-race.json").read_text()) == report["records"]
    weir_long = json.loads((out / "weir-tiny-race-longctx.json").read_text())
    for workload, result in (("tiny-race-longctx", weir_long),
                             ("tiny-race-longctx-few", report["weir_variants"]["few-longctx"])):
        record = records[workload]
        assert record["metric"] == "output_tokens_per_second" and record["peer"] == "vllm-0.0.0-fake"
        assert record["weir"] == round(result["output_tokens_per_second"], 1)
        assert record["peer_value"] == report["vllm"]["longctx_output_tokens_per_second"] > 0
        assert record["ratio"] == round(result["output_tokens_per_second"] / record["peer_value"], 3)
    assert weir_long["num_requests"] == 2 and weir_long["output_tokens"] == 16
    assert weir_long["engine_options"]["max_model_len"] == 768 == report["longctx"]["max_model_len"]
    assert json.loads((out / "weir-tiny-race-1.json").read_text())["engine_options"]["max_model_len"] == 4096
    assert "--max-num-seqs 2" in (out / "weir-tiny-race-longctx-few.log").read_text().splitlines()[0]

    # vLLM: one start-up, at the longer of the two contexts, then the same prompts Weir ran.
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["options"]["max_model_len"] for e in entries if "options" in e] == [4096]
    batches = [e for e in entries if "prompts" in e][1:]  # after its warm-up
    bound = min(10000, TINY_VOCAB_SIZE - 1)
    for batch, (num, ranges, prompt_tokens) in zip(batches, [(1, ((100, 1024), (100, 1024)), None),
                                                             (2, ((300, 600), (8, 8)), weir_long["prompt_tokens"])]):
        prompts, max_tokens = random_workload(num, *ranges, seed=0, max_token_id=bound)
        assert batch["prompts"] == prompts and [p["max_tokens"] for p in batch["params"]] == max_tokens
        assert all(p["temperature"] == 0.6 and p["ignore_eos"] for p in batch["params"])
        assert prompt_tokens in (None, sum(map(len, prompts)))
    assert len(batches) == 2

    markdown = next(out.glob("race-tiny-race-*.md")).read_text()
    assert "| long context: 2 requests, 300-600 prompt + 8 output tokens, output tok/s |" in markdown
    assert "| long context: 2 requests, 300-600 prompt + 8 output tokens, output tok/s (few) |" in markdown
    assert report["command"] == (f"python3 benchmarks/race.py OUT --model {tiny_model} --sizes 1 --variant "
                                 "'few=--max-num-seqs 2' --longctx --longctx-requests 2 --longctx-range 300:600,8:8")


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc (Linux)")
def test_a_sigterm_while_a_run_starts_still_stops_it(race, monkeypatch, tmp_path):
    """The SIGTERM lands just as the child has started, before Popen returns (on a busy machine
    the script's own signal handler can run there): the run is still stopped, child and all, and
    the child itself can still be stopped by SIGTERM."""
    marker = f"sigterm-at-start-{tmp_path.name}"
    started = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # before the caller holds proc
        return proc

    monkeypatch.setattr(race.subprocess, "Popen", popen_then_sigterm)
    previous = signal.signal(signal.SIGTERM, race._exit_on_sigterm)
    try:
        with pytest.raises(SystemExit):
            race.run([sys.executable, "-c", "import time; time.sleep(600)", marker], tmp_path / "run.log")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert_all_gone(lambda: processes_naming(marker))
    assert started[0].returncode == -signal.SIGTERM, "stopped by the group's SIGTERM, not the SIGKILL after"
    assert "[stopped by SystemExit" in (tmp_path / "run.log").read_text()


@pytest.mark.integration
@pytest.mark.skipif(not HAS_PROC, reason="reads /proc (Linux)")
@pytest.mark.parametrize("engine", ["weir", "vllm"])
def test_a_race_stopped_by_sigterm_stops_its_engine_run(tiny_model, fake_vllm, tmp_path, engine):
    """`timeout` around the script sends SIGTERM: the engine run it started (Weir's bench, or
    bench_vllm.py and the engine process vLLM starts) must not outlive it."""
    env, _ = fake_vllm
    engine_marker = f"fake-engine-core-{tmp_path.name}"
    options = ["--sizes", "64", "--skip-vllm"] if engine == "weir" else ["--sizes", "1"]
    race = subprocess.Popen([sys.executable, str(RACE), str(tmp_path / "out"), "--model", str(tiny_model), *options,
                             "--longctx", "--longctx-requests", "1", "--longctx-range", "10:20,2:2"],
                            env={**os.environ, **env, "FAKE_VLLM_HANG": engine_marker}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    # race.py names the model by a path relative to its working folder: match the folder's own
    # tail, which that path and the absolute one share wherever the checkout is.
    model_tail = f"{tiny_model.parent.name}/{tiny_model.name}"

    def engine_pids() -> list[int]:
        return (processes_naming("bench_vllm.py" if engine == "vllm" else "weir.cli.main", model_tail)
                + processes_naming(engine_marker))
    try:
        deadline = time.monotonic() + 300
        while len(engine_pids()) < (2 if engine == "vllm" else 1):  # vLLM: once its engine process is up
            assert race.poll() is None and time.monotonic() < deadline, f"the race did not reach its {engine} run"
            time.sleep(0.2)
        race.send_signal(signal.SIGTERM)
        assert race.wait(60) == 128 + signal.SIGTERM
        assert_all_gone(engine_pids)
        log = tmp_path / "out" / ("weir-tiny-race-64.log" if engine == "weir" else "vllm-tiny-race.log")
        assert "[stopped by SystemExit" in log.read_text()
        assert not (tmp_path / "out" / "latest-records-tiny-race.json").exists()
    finally:
        race.kill()
        for pid in engine_pids():
            os.kill(pid, signal.SIGKILL)
