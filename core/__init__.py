"""Weir: a small, fast LLM inference and serving engine.

Every public name is imported on first use (module ``__getattr__``), so ``import weir`` costs
nothing: the plugin contract (``hookimpl`` and the spec classes) needs only pluggy, and the
engine's names pull in torch only when a program asks for them. Importing a plugin module thus
never imports torch or touches a device, and ``weir --help`` does not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_LAZY = {
    "AttentionBackendSpec": "weir.hookspecs",
    "ModelSpec": "weir.hookspecs",
    "MoEBackendSpec": "weir.hookspecs",
    "PlatformSpec": "weir.hookspecs",
    "hookimpl": "weir.hookspecs",
    "LLM": "weir.llm",
    "SamplingParams": "weir.sampling_params",
    "RequestOutput": "weir.outputs",
    "CompletionOutput": "weir.outputs",
    "Logprob": "weir.outputs",
    "EngineArgs": "weir.config",
    "LLMEngine": "weir.engine",
}

__all__ = list(_LAZY)

if TYPE_CHECKING:
    from weir.config import EngineArgs
    from weir.engine import LLMEngine
    from weir.hookspecs import AttentionBackendSpec, ModelSpec, MoEBackendSpec, PlatformSpec, hookimpl
    from weir.llm import LLM
    from weir.outputs import CompletionOutput, Logprob, RequestOutput
    from weir.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weir' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
