"""Which platform and which attention / MoE backends a run uses.

The platform is the one the user names (``--device``) or else the available platform with the
highest priority. A backend is the one the user names, if it supports the platform's device
type and the model's layer kinds, or else the first of the platform's preferred backends that
does. Anything else is an error saying what is missing.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Callable

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from weir.platform import Platform
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
    none_registered = "no platform plugin is registered" + registry.restriction_note()
    raise RuntimeError("no platform is available: " + ("; ".join(reasons) if reasons else none_registered))


def backend_problems(backend_cls: type, device_type: str, layer_kinds: set[str] | None = None) -> list[str]:
    """What keeps a backend class from serving here, in words for "does not support ...": the
    layer kinds it lacks (attention backends: ``layer_kinds`` given), the device type, this
    environment (a missing package). Empty: it runs here."""
    problems = []
    runs_on_device = (backend_cls.supports(device_type) if layer_kinds is None
                      else backend_cls.supports(device_type, set(layer_kinds)))
    if not runs_on_device:
        unsupported_kinds = set(layer_kinds or ()) - set(getattr(backend_cls, "supported_layer_kinds", ()))
        if unsupported_kinds:
            problems.append(f"layer kinds {sorted(unsupported_kinds)}")
        if device_type not in backend_cls.supported_devices or not unsupported_kinds:
            problems.append(f"device type {device_type!r}")
    unavailable = backend_cls.unavailable_reason()
    if unavailable:
        problems.append(f"this environment ({unavailable})")
    return problems


def select_attention_backend(
    registry: "PluginRegistry", platform: Platform, layer_kinds: set[str], requested: str | None
) -> type:
    missing = functools.partial(backend_problems, device_type=platform.device_type, layer_kinds=set(layer_kinds))
    return _select(
        "attention backend", registry.attention_backends, registry.resolve_attention_backend,
        platform.preferred_attention_backends, requested, missing, platform,
    )


def backend_names(requested: str | None) -> list[str]:
    """``"triton, gdn_fla"`` -> ``["triton", "gdn_fla"]``; empty entries name nothing."""
    return [name.strip() for name in (requested or "").split(",") if name.strip()]


def select_attention_backends(
    registry: "PluginRegistry", platform: Platform, layer_kinds: set[str], requested: str | None
) -> dict[str, type]:
    """One backend per layer kind (a hybrid model mixes paged and linear attention).

    ``requested`` is one backend name or several separated by commas (``"triton,gdn_naive"``).
    Each serves the model's kinds it supports; the others get the platform's defaults. A
    requested backend that serves none of the model's kinds, or two that serve the same kind,
    is an error.
    """
    chosen_by_kind: dict[str, str] = {}
    for name in backend_names(requested):
        backend_cls = registry.resolve_attention_backend(name)  # unknown name -> ValueError
        served = {kind for kind in layer_kinds if kind in backend_cls.supported_layer_kinds}
        if not served:  # raises, naming what the requested backend lacks
            select_attention_backend(registry, platform, layer_kinds, name)
        select_attention_backend(registry, platform, served, name)  # device and environment checks
        for kind in sorted(served):
            if kind in chosen_by_kind:
                raise ValueError(f"attention backends {chosen_by_kind[kind]!r} and {name!r} both serve layer "
                                 f"kind {kind!r}; request one of them")
            chosen_by_kind[kind] = name
    return {kind: select_attention_backend(registry, platform, {kind}, chosen_by_kind.get(kind))
            for kind in sorted(layer_kinds)}


def select_moe_backend(registry: "PluginRegistry", platform: Platform, requested: str | None) -> type:
    missing = functools.partial(backend_problems, device_type=platform.device_type)
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
