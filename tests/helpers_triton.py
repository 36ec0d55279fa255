"""Running Triton kernel checks on the CPU, in Triton's interpreter.

Triton chooses interpreter or compiler when it is first imported (``TRITON_INTERPRET``), and
other tests import it in compiled mode first, so the interpreted checks run in a fresh Python
process: ``run_interpreted_checks("test_x", CHECKS)`` imports ``tests/test_x.py`` there with
``TRITON_INTERPRET=1`` and runs its ``CHECKS`` (each ``check(device)``), printing one
``ok <name>`` line per check that passed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent


def run_checks(checks, device: str) -> None:
    """Run each ``check(device)``, printing ``ok <name>`` after each one that passes."""
    for check in checks:
        check(device)
        print("ok", check.__name__, flush=True)


def run_interpreted_checks(module_name: str, checks, timeout_s: int = 900) -> None:
    """Run ``module_name.CHECKS`` on the CPU in Triton's interpreter (a fresh process); assert
    that every one of ``checks`` passed."""
    code = f"import helpers_triton, {module_name} as checks; helpers_triton.run_checks(checks.CHECKS, 'cpu')"
    _run_in_interpreter(code, [check.__name__ for check in checks], timeout_s)


def kernel_check_tests(module_name: str, checks):
    """The two tests of a module of kernel checks: all of them interpreted on the CPU (in CI; the
    integration tier: the interpreter takes seconds to tens of seconds), and each compiled on CUDA
    (marked gpu). Assign them to ``test_...`` names in that module."""

    @pytest.mark.integration
    def interpreted_on_cpu():
        run_interpreted_checks(module_name, checks)

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    @pytest.mark.parametrize("check", checks, ids=lambda check: check.__name__)
    def compiled_on_cuda(check):
        check("cuda")

    return interpreted_on_cpu, compiled_on_cuda


def kernels_fixture(module_name: str):
    """A ``kernels`` fixture of (kernel module ``weir.kernels.<module_name>``, device): once with
    the kernels interpreted on CPU tensors (``interpreted_module``: a private copy, whatever else
    this process imported), once compiled on a CUDA device (marked gpu). Assign it to ``kernels``
    in the test module."""
    needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

    @pytest.fixture(params=["interpreted", pytest.param("cuda", marks=needs_cuda)])
    def kernels(request):
        from weir.kernels.dispatch import interpreted_module

        if request.param == "interpreted":
            return interpreted_module(module_name), torch.device("cpu")
        return importlib.import_module(f"weir.kernels.{module_name}"), torch.device("cuda")

    return kernels


def run_interpreted(module_name: str, function_name: str, expected_checks: list[str], timeout_s: int = 900) -> None:
    """Run ``module_name.function_name("cpu")`` interpreted; assert every expected check printed ok."""
    _run_in_interpreter(f"import {module_name} as checks; checks.{function_name}('cpu')", expected_checks, timeout_s)


def _run_in_interpreter(code: str, expected_checks: list[str], timeout_s: int) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("WEIR_DISABLE_TRITON", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS_DIR, capture_output=True,
                            text=True, timeout=timeout_s)
    report = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-8000:]}"
    assert result.returncode == 0, report
    passed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    assert passed == set(expected_checks), report
