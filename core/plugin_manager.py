"""The plugin manager: load ``weir`` entry points, collect their specs, resolve and select.

Every spec is attributed to the plugin (entry-point name) and distribution that provided it,
so errors and ``weir plugins`` can say where each thing comes from. Failures are errors that
name the plugin and its package, never silent skips. A registry is an ordinary object that
callers hold; nothing here is module-global state. Loading plugins imports no torch: only
resolving a target does (the interface classes it is checked against import torch).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from weir.hookspecs import (
    ENTRY_POINT_GROUP,
    PROJECT_NAME,
    AttentionBackendSpec,
    ModelSpec,
    MoEBackendSpec,
    PlatformSpec,
    WeirHookSpecs,
)
from weir import selection

if TYPE_CHECKING:
    from weir.platform import Platform

BUILTIN_DISTRIBUTION = "weir-engine"
PLUGINS_ENV_VAR = "WEIR_PLUGINS"
# Weir's own entry points (pyproject.toml): WEIR_PLUGINS must name them too, or they do not load.
BUILTIN_ENTRY_POINTS = ("builtin_models", "builtin_attention", "builtin_moe_backends", "builtin_platforms")

logger = logging.getLogger(__name__)


class PluginError(RuntimeError):
    """A plugin failed to load, returned bad specs, or clashes with another plugin."""


@dataclass(frozen=True)
class Registered:
    """A spec together with the plugin and distribution that provided it."""

    spec: Any  # ModelSpec | AttentionBackendSpec | MoEBackendSpec | PlatformSpec
    plugin_name: str
    distribution: str
    version: str = ""

    @property
    def provider(self) -> str:
        package = f"{self.distribution} {self.version}".strip()
        return f"{self.plugin_name} ({package})"


@dataclass(frozen=True)
class _HookKind:
    hook_name: str
    spec_type: type
    key_field: str  # the spec field that names it: "architecture" or "name"
    label: str  # words for error messages


_HOOK_KINDS = {
    "models": _HookKind("weir_models", ModelSpec, "architecture", "model architecture"),
    "attention_backends": _HookKind(
        "weir_attention_backends", AttentionBackendSpec, "name", "attention backend"
    ),
    "moe_backends": _HookKind("weir_moe_backends", MoEBackendSpec, "name", "MoE backend"),
    "platforms": _HookKind("weir_platforms", PlatformSpec, "name", "platform"),
}


def _interfaces(attribute: str) -> tuple[type, ...]:
    """The base classes one of which each target of a kind must subclass (models have none)."""
    if attribute == "attention_backends":
        from weir.attention import AttentionBackend
        from weir.linear_attention import LinearAttentionBackend

        return AttentionBackend, LinearAttentionBackend
    if attribute == "moe_backends":
        from weir.moe import MoEBackend

        return (MoEBackend,)
    if attribute == "platforms":
        from weir.platform import Platform

        return (Platform,)
    return ()


class PluginRegistry:
    """Specs registered by plugins, keyed by architecture or backend/platform name."""

    def __init__(self) -> None:
        self.plugin_manager = pluggy.PluginManager(PROJECT_NAME)
        self.plugin_manager.add_hookspecs(WeirHookSpecs)
        self.models: dict[str, Registered] = {}
        self.attention_backends: dict[str, Registered] = {}
        self.moe_backends: dict[str, Registered] = {}
        self.platforms: dict[str, Registered] = {}
        # The entry points WEIR_PLUGINS allowed (None: all), for error messages.
        self.allowed_plugins: set[str] | None = None

    def register_module(
        self, plugin: object, name: str, distribution: str = "(not packaged)", version: str = ""
    ) -> None:
        """Register a module or object with ``@hookimpl`` functions and collect its specs."""
        where = f"plugin {name!r} (package {distribution})"
        try:
            self.plugin_manager.register(plugin, name=name)
            # Hook implementations with a misspelt name would otherwise be ignored silently.
            self.plugin_manager.check_pending()
        except (ValueError, pluggy.PluginValidationError) as error:
            if self.plugin_manager.has_plugin(name) and self.plugin_manager.get_plugin(name) is plugin:
                self.plugin_manager.unregister(name=name)
            raise PluginError(f"{where} could not be registered: {error}") from error
        for attribute, kind in _HOOK_KINDS.items():
            table: dict[str, Registered] = getattr(self, attribute)
            for hook_impl in getattr(self.plugin_manager.hook, kind.hook_name).get_hookimpls():
                if hook_impl.plugin_name != name:
                    continue
                for spec in self._call_hook(hook_impl, kind, where):
                    self._add(table, kind, Registered(spec, name, distribution, version))

    @staticmethod
    def _call_hook(hook_impl: Any, kind: _HookKind, where: str) -> list:
        try:
            specs = hook_impl.function()
        except Exception as error:
            raise PluginError(f"{where}: {kind.hook_name}() raised {error!r}") from error
        if not isinstance(specs, list) or not all(isinstance(s, kind.spec_type) for s in specs):
            raise PluginError(
                f"{where}: {kind.hook_name}() must return a list of "
                f"{kind.spec_type.__name__}, got {specs!r}"
            )
        return specs

    @staticmethod
    def _add(table: dict[str, Registered], kind: _HookKind, new: Registered) -> None:
        key = getattr(new.spec, kind.key_field)
        existing = table.get(key)
        if existing is not None and not new.spec.override:
            raise PluginError(
                f"{kind.label} {key!r} is registered by plugin {existing.plugin_name!r} "
                f"(package {existing.distribution}) and again by plugin {new.plugin_name!r} "
                f"(package {new.distribution}); the later spec must set override=True to replace it"
            )
        table[key] = new

    def restriction_note(self) -> str:
        """For "not found" errors: a reminder that WEIR_PLUGINS held some plugins back, or ''."""
        if self.allowed_plugins is None:
            return ""
        return (f" ({PLUGINS_ENV_VAR}={','.join(sorted(self.allowed_plugins))} loads only those entry points; "
                f"Weir's own are {', '.join(BUILTIN_ENTRY_POINTS)})")

    # -- resolution: import a spec's "module:Class" target on demand --------------------------

    def resolve_model(self, architecture: str) -> type:
        return self.resolve("models", architecture)

    def resolve_attention_backend(self, name: str) -> type:
        return self.resolve("attention_backends", name)

    def resolve_moe_backend(self, name: str) -> type:
        return self.resolve("moe_backends", name)

    def resolve_platform(self, name: str) -> type[Platform]:
        return self.resolve("platforms", name)

    def platform_availability(self, name: str) -> tuple[bool, str]:
        """``(available, why not)`` of a registered platform. A plugin whose check itself fails
        (a missing driver package, say) is unavailable, and the reason names it."""
        platform_cls = self.resolve_platform(name)
        try:
            if platform_cls.is_available():
                return True, ""
            return False, platform_cls.unavailable_reason()
        except Exception as error:  # noqa: BLE001 - third-party code: any failure is the plugin's
            registered = self.platforms[name]
            reason = (f"plugin {registered.plugin_name!r} (package {registered.distribution}) failed to say "
                      f"whether it is available: {type(error).__name__}: {error}")
            logger.warning("platform %s is unavailable: %s", name, reason)
            return False, reason

    def resolve(self, attribute: str, key: str) -> type:
        """The class registered under ``key`` in the ``attribute`` table ("models",
        "attention_backends", "moe_backends", "platforms"), imported and checked against its
        interface; PluginError names the plugin when it is not one."""
        table: dict[str, Registered] = getattr(self, attribute)
        if key not in table:
            label = _HOOK_KINDS[attribute].label
            known = ", ".join(sorted(table)) or "(none registered)"
            raise ValueError(f"unknown {label} {key!r}; known: {known}{self.restriction_note()}")
        target_cls = import_target(table[key])
        bases = _interfaces(attribute)
        if bases and not (isinstance(target_cls, type) and issubclass(target_cls, bases)):
            registered = table[key]
            names = " or ".join(f"{base.__module__}.{base.__name__}" for base in bases)
            raise PluginError(
                f"plugin {registered.plugin_name!r} (package {registered.distribution}): target "
                f"{registered.spec.target!r} is not a subclass of {names}"
            )
        if attribute in ("attention_backends", "moe_backends"):
            lacking = [name for name in ("name", "supported_devices") if not hasattr(target_cls, name)]
            if lacking:
                registered = table[key]
                raise PluginError(
                    f"plugin {registered.plugin_name!r} (package {registered.distribution}): backend class "
                    f"{registered.spec.target!r} lacks the class attribute(s) {', '.join(lacking)} (every backend "
                    f"declares name and supported_devices, e.g. frozenset({{'cpu'}}))"
                )
        return target_cls

    # -- selection: which platform and backends a run uses (rules in weir.selection) --------

    def select_platform(self, device: str | None = None) -> Platform:
        """The named platform, or else the available platform with the highest priority."""
        return selection.select_platform(self, device)

    def select_attention_backend(
        self, platform: Platform, layer_kinds: set[str], requested: str | None = None
    ) -> type:
        """``requested`` if it fits, else the platform's first preferred backend that fits."""
        return selection.select_attention_backend(self, platform, layer_kinds, requested)

    def select_attention_backends(
        self, platform: Platform, layer_kinds: set[str], requested: str | None = None
    ) -> dict[str, type]:
        """A backend for each layer kind: ``requested`` where it fits, the platform's defaults elsewhere."""
        return selection.select_attention_backends(self, platform, layer_kinds, requested)

    def select_moe_backend(self, platform: Platform, requested: str | None = None) -> type:
        """``requested`` if it supports the platform, else the first preferred one that does."""
        return selection.select_moe_backend(self, platform, requested)


def import_target(registered: Registered) -> type:
    """Import ``"package.module:Class"``; failures name the plugin that registered it."""
    target = registered.spec.target
    module_name, _, attribute_path = target.partition(":")
    where = f"plugin {registered.plugin_name!r} (package {registered.distribution})"
    if not module_name or not attribute_path:
        raise PluginError(f"{where}: target {target!r} is not of the form 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attribute_path.split("."):
            obj = getattr(obj, part)
    except Exception as error:
        raise PluginError(f"{where}: cannot import target {target!r}: {error!r}") from error
    return obj


def allowed_plugins_from_env() -> set[str] | None:
    """``WEIR_PLUGINS=name1,name2`` as a set; None (load all) when unset or empty."""
    names = {name.strip() for name in os.environ.get(PLUGINS_ENV_VAR, "").split(",")}
    names.discard("")
    return names or None


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    # Built-ins load first, then third-party plugins in a fixed order, so a third-party spec
    # with override=True replaces a built-in one the same way on every machine.
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted(
        entry_points,
        key=lambda ep: (_distribution_name(ep) != BUILTIN_DISTRIBUTION, _distribution_name(ep), ep.name),
    )


def _distribution_name(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    return dist.name if dist is not None else "(unknown package)"


def _distribution_version(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    return dist.version if dist is not None else ""


def load_plugins(allowed: set[str] | None = None) -> PluginRegistry:
    """Load the ``weir`` entry points (those in ``allowed``, default ``$WEIR_PLUGINS``, else all)."""
    if allowed is None:
        allowed = allowed_plugins_from_env()
    entry_points = _entry_points()
    if allowed is not None:
        missing = allowed - {ep.name for ep in entry_points}
        if missing:
            installed = ", ".join(sorted(ep.name for ep in entry_points)) or "(none)"
            raise PluginError(
                f"{PLUGINS_ENV_VAR} names plugins that are not installed: "
                f"{', '.join(sorted(missing))}; installed plugins: {installed}"
            )
    registry = PluginRegistry()
    registry.allowed_plugins = allowed
    for entry_point in entry_points:
        if allowed is not None and entry_point.name not in allowed:
            continue
        distribution = _distribution_name(entry_point)
        try:
            plugin = entry_point.load()
        except Exception as error:
            raise PluginError(
                f"plugin {entry_point.name!r} (package {distribution}, "
                f"entry point {entry_point.value!r}) failed to import: {error!r}"
            ) from error
        registry.register_module(
            plugin, entry_point.name, distribution, _distribution_version(entry_point)
        )
    return registry
