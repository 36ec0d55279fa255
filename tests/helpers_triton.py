"""Running Triton kernel checks on the CPU, in Triton's interpreter.

Triton chooses interpreter or compiler when it is first imported (``TRITON_INTERPRET``), and
other tests import it in compiled mode first, so the interpreted checks run in a fresh Python
process: ``run_interpreted("test_x", "run_checks")`` imports ``tests/test_x.py`` there with
``TRITON_INTERPRET=1`` and calls ``run_checks("cpu")``, which must print one ``ok <name>`` line
per check it ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def run_interpreted(module_name: str, function_name: str, expected_checks: list[str], timeout_s: int = 900) -> None:
    """Run ``module_name.function_name("cpu")`` interpreted; assert every expected check printed ok."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("WEIR_DISABLE_TRITON", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")]))
    code = f"import {module_name} as checks; checks.{function_name}('cpu')"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS_DIR, capture_output=True,
                            text=True, timeout=timeout_s)
    report = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-8000:]}"
    assert result.returncode == 0, report
    passed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    assert passed == set(expected_checks), report
