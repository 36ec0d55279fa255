"""The plugin contract: hook specifications and the specs plugins return.

Every plugin is a module (or object) registered under the ``weir`` entry-point group that
implements some of the hooks below with ``@weir.hookimpl``. Each hook returns a list of specs:
a name plus a ``"module:Class"`` target that is imported only when selected, so importing a
plugin never imports torch-heavy code or touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import pluggy

PROJECT_NAME = "weir"
ENTRY_POINT_GROUP = "weir"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class ModelSpec:
    """A model architecture, named as in the checkpoint's ``config.json`` ``architectures``."""

    architecture: str
    target: str  # "package.module:Class"
    override: bool = False  # replace an architecture another plugin already registered


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention backend. The target class implements ``weir.attention.AttentionBackend``
    (paged-KV attention) or ``weir.linear_attention.LinearAttentionBackend`` (layers with a
    per-request state, such as Gated DeltaNet); its ``supported_layer_kinds`` say which layers it
    serves, and a hybrid model gets one backend per layer kind. ``name`` is what users select
    (``attention_backend=``); it should equal the class's ``name``, which the logs show."""

    name: str
    target: str
    override: bool = False


@dataclass(frozen=True)
class MoEBackendSpec:
    """An expert-computation backend; the target implements ``weir.moe.MoEBackend`` and is
    constructed with no arguments. ``name`` is what users select (``moe_backend=``); it should
    equal the class's ``name``, which the logs show."""

    name: str
    target: str
    override: bool = False


@dataclass(frozen=True)
class PlatformSpec:
    """A platform driver; the target class implements ``weir.platform.Platform``.

    Among the available platforms, the one with the highest ``priority`` is active.
    """

    name: str
    target: str
    priority: int = 0
    override: bool = False


class WeirHookSpecs:
    @hookspec
    def weir_models(self) -> list[ModelSpec]:
        """Model architectures this plugin provides."""

    @hookspec
    def weir_attention_backends(self) -> list[AttentionBackendSpec]:
        """Attention backends this plugin provides."""

    @hookspec
    def weir_moe_backends(self) -> list[MoEBackendSpec]:
        """MoE (expert computation) backends this plugin provides."""

    @hookspec
    def weir_platforms(self) -> list[PlatformSpec]:
        """Platform drivers this plugin provides."""
