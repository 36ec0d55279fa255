"""Which platform and which attention / MoE backends a run uses.

The platform is the one the user names (``--device``) or else the available platform with the
highest priority. A backend is the one the user names, if it supports the platform's device
type and the model's layer kinds, or else the first of the platform's preferred backends that
does. Anything else is an error saying what is missing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from weir.platform import Platform

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from weir.plugin_manager import PluginRegistry  # noqa: F401


def select_platform(registry: "PluginRegistry", device: str | None) -> Platform:
    if device is not None:
        platform_cls = registry.resolve_platform(device)  # unknown name -> ValueError
        available, reason = registry.platform_availability(device)
        if not available:
            raise RuntimeError(f"device {device!r} was requested but is not available: {reason}")
        return platform_cls()
    # Stable sort: platforms of equal priority keep their registration order.
    by_priority = sorted(registry.platforms, key=lambda name: -registry.platforms[name].spec.priority)
    reasons = []
    for name in by_priority:
        available, reason = registry.platform_availability(name)
        if available:
            return registry.resolve_platform(name)()
        reasons.append(f"{name}: {reason}")
    raise RuntimeError(
        "no platform is available: "
        + ("; ".join(reasons) if reasons else "no platform plugin is registered")
    )


def select_attention_backend(
    registry: "PluginRegistry", platform: Platform, layer_kinds: set[str], requested: str | None
) -> type:
    def missing(backend_cls: type) -> list[str]:
        problems = []
        if platform.device_type not in backend_cls.supported_devices:
            problems.append(f"device type {platform.device_type!r}")
        unsupported_kinds = set(layer_kinds) - set(backend_cls.supported_layer_kinds)
        if unsupported_kinds:
            problems.append(f"layer kinds {sorted(unsupported_kinds)}")
        unavailable = getattr(backend_cls, "unavailable_reason", lambda: None)()
        if unavailable:
            problems.append(f"this environment ({unavailable})")
        return problems

    return _select(
        "attention backend", registry.attention_backends, registry.resolve_attention_backend,
        platform.preferred_attention_backends, requested, missing, platform,
    )


def select_attention_backends(
    registry: "PluginRegistry", platform: Platform, layer_kinds: set[str], requested: str | None
) -> dict[str, type]:
    """One backend per layer kind (a hybrid model mixes paged and linear attention).

    ``requested`` serves every kind it supports; the others get the platform's defaults. A
    requested backend that serves none of the model's kinds is an error.
    """
    if requested is not None:
        requested_cls = registry.resolve_attention_backend(requested)
        served = {kind for kind in layer_kinds if kind in requested_cls.supported_layer_kinds}
        if not served:  # raises, naming what the requested backend lacks
            select_attention_backend(registry, platform, layer_kinds, requested)
        select_attention_backend(registry, platform, served, requested)  # device check
    chosen = {}
    for kind in sorted(layer_kinds):
        use_requested = requested is not None and kind in requested_cls.supported_layer_kinds
        chosen[kind] = select_attention_backend(registry, platform, {kind}, requested if use_requested else None)
    return chosen


def select_moe_backend(registry: "PluginRegistry", platform: Platform, requested: str | None) -> type:
    def missing(backend_cls: type) -> list[str]:
        if platform.device_type in backend_cls.supported_devices:
            return []
        return [f"device type {platform.device_type!r}"]

    return _select(
        "MoE backend", registry.moe_backends, registry.resolve_moe_backend,
        platform.preferred_moe_backends, requested, missing, platform,
    )


def _select(
    label: str,
    registered: dict,
    resolve: Callable[[str], type],
    preferred: tuple[str, ...],
    requested: str | None,
    missing: Callable[[type], list[str]],
    platform: Platform,
) -> type:
    if requested is not None:
        backend_cls = resolve(requested)  # unknown name -> ValueError listing the known ones
        problems = missing(backend_cls)
        if problems:
            raise ValueError(
                f"{label} {requested!r} does not support {' and '.join(problems)}, "
                f"needed on platform {platform.name!r}"
            )
        return backend_cls
    tried = []
    for name in preferred:
        if name not in registered:
            tried.append(f"{name!r} is not registered")
            continue
        backend_cls = resolve(name)
        problems = missing(backend_cls)
        if not problems:
            unavailable = [reason for reason in tried if "this environment" in reason]
            if unavailable:
                # A faster backend the platform prefers is installed badly or not at all: say so,
                # since the fallback can be much slower (no CUDA graphs, host copies).
                logger.warning("%s %r is used instead of a preferred one: %s", label, name, "; ".join(unavailable))
            return backend_cls
        tried.append(f"{name!r} does not support {' and '.join(problems)}")
    raise ValueError(
        f"no {label} fits platform {platform.name!r}: {'; '.join(tried) or 'it prefers none'}; "
        f"registered: {', '.join(sorted(registered)) or '(none)'}"
    )
