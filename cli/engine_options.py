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
# vLLM's short spellings of engine flags.
_SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}


def engine_option_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineArgs) if f.name not in _POSITIONAL]


def with_engine_options(command):
    """Give ``command`` one ``--flag`` per ``EngineArgs`` field; it receives them as ``engine_options``
    (a dict of only the flags that differ from their defaults). A command whose MODEL is a
    positional argument also takes it as ``--model MODEL``, as vLLM's commands do."""
    hints = typing.get_type_hints(EngineArgs)
    signature = inspect.signature(command)
    parameters = [p for p in signature.parameters.values() if p.name != "engine_options"]
    model_is_positional = any(p.name == "model" and isinstance(p.default, typer.models.ArgumentInfo)
                              for p in parameters)
    if model_is_positional:
        # Not required any more: either spelling gives it (checked in the wrapper).
        parameters = [p.replace(default=typer.Argument(None, metavar="MODEL", help=p.default.help))
                      if p.name == "model" else p for p in parameters]
        parameters.append(inspect.Parameter("model_flag", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
                                            default=typer.Option(None, "--model", help="MODEL, as vLLM spells it")))
    for field in engine_option_fields():
        flag = "--" + field.name.replace("_", "-")
        if hints[field.name] is bool:
            flag = f"{flag}/--no-{field.name.replace('_', '-')}"
        option = typer.Option(field.default, flag, *_SHORT_FLAGS.get(field.name, []), help=field.metadata.get("help"),
                              rich_help_panel="Engine options", show_default=True)
        # A JSON-valued option (speculative_config) is a string on the command line.
        annotation = str | None if field.metadata.get("json") else hints[field.name]
        parameters.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=option, annotation=annotation))

    @functools.wraps(command)
    def wrapper(**kwargs):
        if model_is_positional:
            kwargs["model"] = _one_model(kwargs["model"], kwargs.pop("model_flag"), signature)
        engine_options = {}
        for field in engine_option_fields():
            value = kwargs.pop(field.name)
            if value != field.default:
                engine_options[field.name] = value
        return command(engine_options=engine_options, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=parameters)
    return wrapper


def _one_model(positional: str | None, flag: str | None, signature: inspect.Signature) -> str | None:
    if positional is not None and flag is not None and positional != flag:
        raise typer.BadParameter(f"MODEL {positional!r} and --model {flag!r} differ; give one of them",
                                 param_hint="--model")
    model = positional if positional is not None else flag
    model_required = signature.parameters["model"].default.default is ...
    if model is None and model_required:
        raise typer.BadParameter("give the model, as MODEL or --model MODEL", param_hint="MODEL")
    return model
