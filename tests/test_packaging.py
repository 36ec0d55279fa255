"""The built wheel holds every module of the four source folders and the entry points.

Editable installs and CI import from the folders themselves, so a subpackage that packaging
missed would pass every other test and still be absent for users who ``pip install`` Weir.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Source folder -> its import name (pyproject.toml's package-dir).
PACKAGE_DIRS = {"core": "weir", "plugins": "weir/plugins", "cli": "weir/cli", "server": "weir/server"}


def source_modules() -> set[str]:
    """Every .py file of the four folders, as its path inside the wheel."""
    modules = set()
    for folder, package in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                modules.add(f"{package}/{path.relative_to(REPO / folder).as_posix()}")
    return modules


def build_wheel(tmp_path: Path) -> Path:
    """``pip wheel`` of a copy of the sources (a build in the checkout would leave a build/ folder
    there, whose stale files a later build would package)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in PACKAGE_DIRS:
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip wheel failed (needs setuptools>=77: pip install -e '.[test]'):\n" \
                                   f"{result.stdout}\n{result.stderr}"
    wheels = list((tmp_path / "dist").glob("weir_engine-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> dict[str, bytes]:
    wheel = build_wheel(tmp_path_factory.mktemp("wheel"))
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_the_wheel_holds_every_module_and_nothing_else(wheel_files):
    expected = source_modules()
    assert "weir/kernels/dispatch.py" in expected and "weir/plugins/attention/__init__.py" in expected
    packaged = {name for name in wheel_files if not name.startswith("weir_engine-")}
    assert sorted(expected - packaged) == [], "modules missing from the wheel"
    assert sorted(packaged - expected) == [], "files in the wheel that are no module of the four folders"


def test_the_wheel_declares_the_console_script_and_the_builtin_plugins(wheel_files):
    entry_points = next(data for name, data in wheel_files.items() if name.endswith(".dist-info/entry_points.txt"))
    text = entry_points.decode()
    assert "weir = weir.cli.main:app" in text
    for name, module in [("builtin_models", "weir.plugins.models"), ("builtin_attention", "weir.plugins.attention"),
                         ("builtin_moe_backends", "weir.plugins.moe_backends"),
                         ("builtin_platforms", "weir.plugins.platforms")]:
        assert f"{name} = {module}" in text
