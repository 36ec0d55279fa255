"""Whether an op runs its Triton kernel or its torch version.

Triton serves CUDA tensors (ROCm reports the same device type) when it imports; setting
``WEIR_DISABLE_TRITON=1`` forces the torch versions everywhere, to bisect a wrong answer or
compare speed. The variable is read once, at the first op (``use_triton`` runs for every layer
op of every step); code that changes it later calls ``reread_triton_switch()``, as
``forced_torch_ops`` does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

DISABLE_ENV = "WEIR_DISABLE_TRITON"


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def triton_enabled() -> bool:
    """Triton imports and ``WEIR_DISABLE_TRITON`` is not ``1`` (as read at the first call)."""
    return os.environ.get(DISABLE_ENV, "") != "1" and triton_importable()


def reread_triton_switch() -> None:
    """Forget ``WEIR_DISABLE_TRITON``'s value: the next op reads the environment again."""
    triton_enabled.cache_clear()


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s op should launch its Triton kernel."""
    if not tensor.is_cuda:  # cheaper than tensor.device.type: this runs for every layer op
        return False
    return triton_enabled()


@contextlib.contextmanager
def forced_torch_ops(forced: bool = True):
    """Inside the block, every op runs its torch version (``forced``) or may use Triton (not);
    afterwards the environment and the ops' choice are what they were."""
    previous = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1" if forced else "0"
    reread_triton_switch()
    try:
        yield
    finally:
        if previous is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = previous
        reread_triton_switch()


def _module_path(name: str) -> str:
    """``weir.kernels.<name>`` for a bare name; a dotted name is a full module path already."""
    return name if "." in name else f"weir.kernels.{name}"


@functools.cache
def triton_module(name: str) -> ModuleType:
    """A Triton kernel module, imported on first use (never at Weir's import): a bare name is
    ``weir.kernels.<name>``, a dotted one a full path (``weir.sample.triton_sampler``)."""
    return importlib.import_module(_module_path(name))


@functools.cache
def interpreted_module(name: str) -> ModuleType:
    """A private copy of kernel module ``name`` (as ``triton_module`` names it) whose kernels
    run in Triton's interpreter.

    For tests and debugging on the CPU (CPU tensors work). Triton picks interpreter or compiler
    when a kernel is decorated, so the copy is executed with ``TRITON_INTERPRET=1`` set just for
    its import; the regular module, compiled or not, is left as it is. Limit: the copy's kernels
    may call its own ``@triton.jit`` helpers and ``tl`` builtins, but not the ``@triton.jit``
    functions of ``triton.language.standard`` (``tl.zeros``, ``tl.cdiv``, ``tl.max``...), which
    stay compiled; a module that needs them is interpreted in a subprocess instead.
    """
    path = _module_path(name)
    spec = importlib.util.find_spec(path)
    if spec is None or spec.origin is None:
        raise ValueError(f"no kernel module {path}")
    package, _, module_name = path.rpartition(".")
    copy_spec = importlib.util.spec_from_file_location(f"{package}._interpreted_{module_name}", spec.origin)
    module = importlib.util.module_from_spec(copy_spec)
    # Triton itself must be imported in its normal mode first: its own lazily imported parts
    # check, at their import, that the standard library matches the mode of the moment.
    importlib.import_module("triton.language")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        copy_spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module
