"""Engine options as CLI flags, generated from ``EngineArgs`` so the two never drift apart."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing

import typer

from weir.config import EngineArgs

# Fields given as a command's positional argument rather than as a flag.
_POSITIONAL = {"model"}


def engine_option_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineArgs) if f.name not in _POSITIONAL]


def with_engine_options(command):
    """Give ``command`` one ``--flag`` per ``EngineArgs`` field; it receives them as ``engine_options``
    (a dict of only the flags that differ from their defaults)."""
    hints = typing.get_type_hints(EngineArgs)
    signature = inspect.signature(command)
    parameters = [p for p in signature.parameters.values() if p.name != "engine_options"]
    for field in engine_option_fields():
        flag = "--" + field.name.replace("_", "-")
        if hints[field.name] is bool:
            flag = f"{flag}/--no-{field.name.replace('_', '-')}"
        option = typer.Option(field.default, flag, help=field.metadata.get("help"),
                              rich_help_panel="Engine options", show_default=True)
        parameters.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=option, annotation=hints[field.name]))

    @functools.wraps(command)
    def wrapper(**kwargs):
        engine_options = {}
        for field in engine_option_fields():
            value = kwargs.pop(field.name)
            if value != field.default:
                engine_options[field.name] = value
        return command(engine_options=engine_options, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=parameters)
    return wrapper
