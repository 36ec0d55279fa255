"""Weir: a small, fast LLM inference and serving engine.

The plugin contract (``hookimpl`` and the spec classes) is imported eagerly and is light;
everything that needs torch is imported on first use, so importing a plugin module never
pulls in torch or touches a device.
"""

from weir.hookspecs import (
    AttentionBackendSpec,
    ModelSpec,
    MoEBackendSpec,
    PlatformSpec,
    hookimpl,
)

__version__ = "0.1.0"

_LAZY = {
    "LLM": "weir.llm",
    "SamplingParams": "weir.sampling_params",
    "RequestOutput": "weir.outputs",
    "CompletionOutput": "weir.outputs",
    "Logprob": "weir.outputs",
    "EngineArgs": "weir.config",
    "LLMEngine": "weir.engine",
}

__all__ = [
    "AttentionBackendSpec", "ModelSpec", "MoEBackendSpec", "PlatformSpec", "hookimpl", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weir' has no attribute {name!r}")
