"""``benchmarks/serve_race.py`` on the CPU: its options, its reports from bench results, and a
whole race of ``weir serve`` on the tiny model against a fake peer server process."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench_fake_server import FAKE_VERSION
from helpers_processes import HAS_PROC, assert_all_gone, processes_naming

pytestmark = pytest.mark.integration  # weir serve processes

ROOT = Path(__file__).resolve().parents[1]
FAKE_PEER = f"{sys.executable} {Path(__file__).parent / 'bench_fake_server.py'}"


@pytest.fixture(scope="module")
def race():
    spec = importlib.util.spec_from_file_location("serve_race", ROOT / "benchmarks" / "serve_race.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_options(race, tmp_path):
    model = _model(tmp_path, "m")
    args = race.parse_args([str(tmp_path / "out"), "--model", str(model), "--rates", "4,0.5,inf"])
    assert args.rates == [4.0, 0.5, math.inf] and args.engines == ["weir", "vllm"]
    assert [race.rate_label(rate) for rate in args.rates] == ["4", "0.5", "inf"]
    assert [race.num_prompts_for(rate, args) for rate in (4.0, 16.0, 0.5, math.inf)] == [200, 320, 200, 400]
    args = race.parse_args([str(tmp_path), "--model", str(model), "--num-prompts", "7", "--engines", "weir"])
    assert race.num_prompts_for(math.inf, args) == race.num_prompts_for(4.0, args) == 7 and args.engines == ["weir"]


@pytest.mark.parametrize("options, message", [
    (["--rates", "4,0"], "--rates wants positive numbers"),
    (["--rates", "fast"], "--rates wants positive numbers"),
    (["--engines", "weir,sglang"], "--engines wants"),
    (["--input-len", "4000", "--output-len", "200"], "exceed --max-model-len 4096"),
    (["--model", "{other}"], "the same name"),
    (["--tokenizer", "{missing}"], "is not a folder"),
])
def test_bad_options_are_named(race, tmp_path, capsys, options, message):
    model = _model(tmp_path, "m")
    (tmp_path / "again").mkdir()
    other = _model(tmp_path / "again", "m")
    options = [o.format(other=other, missing=tmp_path / "nope") for o in options]
    with pytest.raises(SystemExit):
        race.parse_args([str(tmp_path / "out"), "--model", str(model), *options])
    assert message in capsys.readouterr().err


def _result(ttft_p99: float, tpot_mean: float, throughput: float, num_prompts: int = 200) -> dict:
    return {"num_prompts": num_prompts, "completed": num_prompts, "failed": 0, "duration": 50.0,
            "output_throughput": throughput, "mean_ttft_ms": ttft_p99 / 3, "median_ttft_ms": ttft_p99 / 4,
            "p99_ttft_ms": ttft_p99, "mean_tpot_ms": tpot_mean, "median_tpot_ms": tpot_mean * 0.9,
            "p99_tpot_ms": tpot_mean * 1.5}


def test_reports_from_bench_results(race, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    runs = {("weir", "4"): _result(150.0, 6.0, 3000.0), ("vllm", "4"): _result(160.0, 7.5, 2900.0),
            ("weir", "inf"): _result(900.0, 9.0, 9000.0, 400), ("vllm", "inf"): _result(600.0, 8.0, 8800.0, 400)}
    for (engine, label), result in runs.items():
        (out / f"{engine}-m-rate{label}.json").write_text(json.dumps(result))
    for engine, version in (("weir", "0.1.0"), ("vllm", "0.26.0")):
        (out / f"{engine}-m-server.json").write_text(json.dumps(
            {"engine": engine, "version": version, "startup_seconds": 12.0, "device": "NVIDIA H200"}))
    assert race.main([str(out), "--model", "m", "--rates", "4,16,inf", "--report-only"]) == 0
    records = json.loads((out / "latest-records-serve.json").read_text())
    by_key = {(r["workload"], r["metric"]): r for r in records}
    p99 = by_key["serve-m-rate4", "p99_ttft_ms"]
    assert p99 == {"workload": "serve-m-rate4", "metric": "p99_ttft_ms", "weir": 150.0, "peer": "vllm-0.26.0",
                   "peer_value": 160.0, "ratio": round(150 / 160, 3), "date": p99["date"], "device": "NVIDIA H200"}
    assert by_key["serve-m-rateinf", "mean_tpot_ms"]["ratio"] == round(9.0 / 8.0, 3)
    assert {metric for _, metric in by_key} == {"output_tokens_per_second", "mean_ttft_ms", "median_ttft_ms",
                                                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms"}
    assert not any(workload == "serve-m-rate16" for workload, _ in by_key)  # not run: no record
    assert json.loads((out / "serve-race.json").read_text())["records"] == records
    markdown = (out / "serve-race.md").read_text()
    assert "| 4 | 200 | Weir | 3,000 | 50.0 | 37.5 | 150.0 | 6.00 | 5.40 | 9.00 |" in markdown
    assert "| 4 |  | Weir / vLLM | 1.03 | 0.94 | 0.94 | 0.94 | 0.80 | 0.80 | 0.80 |" in markdown
    assert "| 16 | - | Weir | not run |" in markdown
    assert "missed: p99_ttft_ms 1.50x at rate inf, mean_tpot_ms 1.12x at rate inf." in markdown


def test_race_weir_on_the_tiny_model_against_a_fake_peer(race, tiny_llama_path, tmp_path):
    """The whole run on the CPU: both servers start on free ports, are warmed up, benched at
    each rate with the same client, stopped, and the report compares them."""
    out = tmp_path / "race"
    model = tmp_path / "tiny"
    model.symlink_to(tiny_llama_path, target_is_directory=True)
    code = race.main([str(out), "--model", str(model), "--rates", "inf", "--num-prompts", "3", "--input-len", "6",
                      "--output-len", "4", "--max-model-len", "128", "--warmup-prompts", "1",
                      "--weir-args", "--device cpu", "--bench-args=--text",
                      "--vllm-command", FAKE_PEER, "--startup-timeout", "120", "--run-timeout", "120"])
    report = json.loads((out / "serve-race.json").read_text())
    assert code == 0, report["failures"]
    weir_run, peer_run = (json.loads((out / f"{engine}-tiny-rateinf.json").read_text()) for engine in ("weir", "vllm"))
    assert weir_run["completed"] == peer_run["completed"] == 3 and weir_run["total_output_tokens"] == 3 * 4
    assert report["servers"]["vllm-tiny"]["version"] == FAKE_VERSION
    weir_command = report["servers"]["weir-tiny"]["command"]
    assert "--load-format dummy --max-model-len 128 --served-model-name tiny" in weir_command
    assert weir_run["model_id"] == "tiny"  # the client found the served name at /v1/models
    ratio = {r["metric"]: r for r in report["records"]}["p99_ttft_ms"]
    assert ratio["peer"] == f"vllm-{FAKE_VERSION}" and ratio["ratio"] == round(ratio["weir"] / ratio["peer_value"], 3)
    for log in ("weir-tiny-server.log", "vllm-tiny-server.log", "weir-tiny-warmup.log", "vllm-tiny-rateinf.log"):
        assert (out / log).read_text().startswith("$ ")
    assert "| inf | 3 | Weir |" in (out / "serve-race.md").read_text()
    # Each run draws prompts of its own, the same for both engines: the warm-up the seed's, the
    # first rate's seed + 1 (an earlier run's prompts would be prefix-cache hits).
    for engine in ("weir", "vllm"):
        seeds = [re.search(r"--seed (\d+)", (out / f"{engine}-tiny-{run}.log").read_text()).group(1)
                 for run in ("warmup", "rateinf")]
        assert seeds == ["0", "1"], (engine, seeds)
    # The report's command reruns this race: every changed workload option, no machine's paths.
    for option in ("--num-prompts=3", "--input-len=6", "--output-len=4", "--warmup-prompts=1", "--bench-args=--text"):
        assert option in report["command"], report["command"]
    assert sys.executable not in weir_command and weir_command.startswith("python3 -m weir.cli.main serve")


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc (Linux)")
def test_a_race_stopped_by_sigterm_stops_its_server(tmp_path):
    """`timeout` around the script sends SIGTERM: the server it started must not outlive it."""
    model = _model(tmp_path, "sigterm-model")

    def server_pids() -> list[int]:  # the race's own command line names the model too
        return processes_naming(str(model), "bench_fake_server.py")
    race = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "serve_race.py"), str(tmp_path / "out"), "--model", str(model),
         "--engines", "vllm", "--vllm-command", FAKE_PEER, "--rates", "0.5", "--num-prompts", "100",
         "--warmup-prompts", "1", "--bench-args=--text"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out" / "vllm-sigterm-model-rate0.5.log").exists():  # the server is up, benched
            assert race.poll() is None and time.monotonic() < deadline, "the race did not reach its bench run"
            time.sleep(0.2)
        assert server_pids()  # the fake server is up
        race.send_signal(signal.SIGTERM)
        assert race.wait(60) == 128 + signal.SIGTERM
        assert_all_gone(server_pids)
    finally:
        race.kill()
