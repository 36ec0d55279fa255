"""The CLI answers help, argument errors and the plugin listing without importing torch (about a
second saved per call), and ``import weir`` imports nothing heavy; run in a fresh interpreter, since this one has
torch loaded already."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "numpy", "triton", "uvicorn", "starlette")

PROGRAM = """
import json, sys
from typer.testing import CliRunner
from weir.cli.main import app

runner = CliRunner()
exit_codes = {}
for args in (["--help"], ["serve", "--help"], ["generate", "--help"], ["bench", "throughput", "--help"],
             ["bench", "serve", "--help"], ["serve", "--max-num-seqs", "many"], ["serve", "--no-such-flag"],
             ["plugins"], ["plugins", "--json"]):
    exit_codes[" ".join(args)] = runner.invoke(app, args).exit_code
print(json.dumps({"exit_codes": exit_codes, "heavy": sorted(m for m in HEAVY if m in sys.modules)}))
"""


def run_fresh(program: str) -> dict:
    result = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{program}"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_help_argument_errors_and_the_plugin_listing_import_no_torch():
    report = run_fresh(PROGRAM)
    codes = report["exit_codes"]
    assert all(codes[args] == 0 for args in codes if args.endswith("--help") or args.startswith("plugins")), codes
    assert codes["serve --max-num-seqs many"] == 2 and codes["serve --no-such-flag"] == 2, codes
    assert report["heavy"] == []


def test_importing_weir_and_the_plugin_contract_imports_nothing_heavy():
    report = run_fresh("import sys, json\nimport weir\nfrom weir import hookimpl, ModelSpec, PlatformSpec\n"
                       "import weir.plugin_manager, weir.plugins.models, weir.plugins.attention\n"
                       "import weir.plugins.moe_backends, weir.plugins.platforms\n"
                       "print(json.dumps({'heavy': sorted(m for m in HEAVY if m in sys.modules)}))")
    assert report["heavy"] == []
