"""``weir plugins``: every registered model, backend and platform and who provides it, read from
the plugins' specs alone (no target is imported, so no torch); ``--check`` also says whether each
is usable on this machine, which imports them."""

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


def describe_plugins(registry: PluginRegistry, check: bool = True) -> list[dict[str, Any]]:
    """One row per registered spec. With ``check``, ``available`` says whether it is usable here
    (each target is imported for it); without, ``available`` is None and nothing is imported."""
    active_platform, no_platform_reason = _active_platform(registry) if check else (None, "")
    rows = []
    for attribute, kind in _KINDS:
        table: dict[str, Registered] = getattr(registry, attribute)
        for name in sorted(table):
            row = _row(kind, name, table[name])
            if not check:
                row["available"] = None
                rows.append(row)
                continue
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


_COLUMNS = ("kind", "name", "provider", "target", "available")
_UNCHECKED_COLUMNS = _COLUMNS[:-1]
# Never broken across lines: a name or target cut in two cannot be found or copied.
_UNBROKEN = ("name", "target")


def _columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    return _COLUMNS if any(row["available"] is not None for row in rows) else _UNCHECKED_COLUMNS


def _cells(row: dict[str, Any]) -> dict[str, str]:
    if row["available"] is None:
        available = ""
    elif row["available"]:
        available = "yes (active)" if row["active"] else "yes"
    else:
        available = f"no: {row['reason']}" if row["reason"] else "no"
    kind = f"{row['kind']} ({', '.join(row['layer_kinds'])})" if row["layer_kinds"] else row["kind"]
    return {"kind": kind, "name": row["name"], "provider": row["provider"], "target": row["target"],
            "available": available}


def plain_rows(rows: list[dict[str, Any]]) -> str:
    """Aligned columns, one entry per line, nothing wrapped: for pipes, files and narrow terminals."""
    columns = _columns(rows)
    table = [dict(zip(columns, columns))] + [_cells(row) for row in rows]
    widths = {column: max(len(cells[column]) for cells in table) for column in columns}
    lines = ["  ".join(cells[column].ljust(widths[column]) for column in columns).rstrip() for cells in table]
    return "\n".join(lines)


def _table_fits(rows: list[dict[str, Any]], width: int) -> bool:
    """Whether a boxed table leaves the other columns room beside unbroken names and targets."""
    cells, columns = [_cells(row) for row in rows], _columns(rows)
    unbroken = sum(max(len(column), *(len(c[column]) for c in cells)) for column in _UNBROKEN)
    others = sum(min(12, max(len(c[column]) for c in cells)) for column in columns if column not in _UNBROKEN)
    return unbroken + others + 3 * len(columns) + 1 <= width


def print_listing(rows: list[dict[str, Any]], console=None) -> None:
    """A boxed table on a terminal wide enough for it; plain rows otherwise."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not console.is_terminal or not _table_fits(rows, console.width):
        # soft_wrap: the terminal, not rich, decides where an over-long line continues.
        console.print(plain_rows(rows), soft_wrap=True, markup=False, highlight=False)
        return
    table = Table(title="Weir plugins")
    columns = _columns(rows)
    for column in columns:
        table.add_column(column, no_wrap=column in _UNBROKEN, overflow="fold")
    for row in rows:
        cells = _cells(row)
        table.add_row(*(cells[column] for column in columns))
    console.print(table)


def plugins(
    check: bool = typer.Option(False, "--check", help="Also say whether each one is usable here (imports them, "
                               "torch with them: a second or more)."),
    json_output: bool = typer.Option(False, "--json", help="Print the listing as JSON."),
) -> None:
    """List model architectures, attention and MoE backends, and platforms from all plugins."""
    try:
        registry = load_plugins()
    except PluginError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=1) from error
    rows = describe_plugins(registry, check=check)
    if json_output:
        typer.echo(json.dumps(rows, indent=2))
    else:
        print_listing(rows)
