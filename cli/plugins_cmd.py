"""``weir plugins``: every registered model, backend and platform, who provides it, and
whether it is usable on this machine."""

from __future__ import annotations

import json
from typing import Any

import typer

from weir.plugin_manager import PluginError, PluginRegistry, Registered, load_plugins
from weir.selection import backend_problems

# (registry attribute, kind shown to the user)
_KINDS = (
    ("models", "model"),
    ("attention_backends", "attention"),
    ("moe_backends", "moe"),
    ("platforms", "platform"),
)


def _row(kind: str, name: str, registered: Registered) -> dict[str, Any]:
    return {
        "kind": kind,
        "name": name,
        "plugin": registered.plugin_name,
        "distribution": registered.distribution,
        "version": registered.version,
        "provider": registered.provider,
        "target": registered.spec.target,
        "available": False,
        "active": False,
        "reason": "",
        "layer_kinds": [],  # attention backends: the layer kinds they serve
    }


def _active_platform(registry: PluginRegistry) -> tuple[Any, str]:
    try:
        return registry.select_platform(None), ""
    except (RuntimeError, ValueError) as error:  # no platform: backends can't be judged
        return None, str(error)


def describe_plugins(registry: PluginRegistry) -> list[dict[str, Any]]:
    """One row per registered spec; ``available`` says whether it is usable here."""
    active_platform, no_platform_reason = _active_platform(registry)
    rows = []
    for attribute, kind in _KINDS:
        table: dict[str, Registered] = getattr(registry, attribute)
        for name in sorted(table):
            row = _row(kind, name, table[name])
            try:
                target_cls = registry.resolve(attribute, name)
            except PluginError as error:  # listed anyway: the table must show what is broken
                row["reason"] = (f"not importable: {error.__cause__!r}" if error.__cause__ is not None
                                 else str(error))
                rows.append(row)
                continue
            if kind == "attention":
                row["layer_kinds"] = sorted(getattr(target_cls, "supported_layer_kinds", ()))
            if kind == "platform":
                row["available"], row["reason"] = registry.platform_availability(name)
                row["active"] = active_platform is not None and active_platform.name == name
            elif kind == "model":
                row["available"] = True
            elif active_platform is None:
                row["reason"] = no_platform_reason
            else:  # the rules selection applies: supports() (a backend may override it), its packages
                problems = backend_problems(target_cls, active_platform.device_type,
                                            set(row["layer_kinds"]) if kind == "attention" else None)
                row["available"] = not problems
                row["reason"] = f"does not support {' and '.join(problems)}" if problems else ""
            rows.append(row)
    return rows


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Weir plugins")
    for column in ("kind", "name", "provider", "target", "available"):
        table.add_column(column, overflow="fold")
    for row in rows:
        if row["available"]:
            available = "yes (active)" if row["active"] else "yes"
        else:
            available = f"no: {row['reason']}" if row["reason"] else "no"
        kind = f"{row['kind']} ({', '.join(row['layer_kinds'])})" if row["layer_kinds"] else row["kind"]
        table.add_row(kind, row["name"], row["provider"], row["target"], available)
    Console().print(table)


def plugins(
    json_output: bool = typer.Option(False, "--json", help="Print the listing as JSON."),
) -> None:
    """List model architectures, attention and MoE backends, and platforms from all plugins."""
    try:
        registry = load_plugins()
    except PluginError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=1) from error
    rows = describe_plugins(registry)
    if json_output:
        typer.echo(json.dumps(rows, indent=2))
    else:
        _print_table(rows)
