"""Build a model on the meta device, materialise it, and stream checkpoint tensors into it.

Checkpoint names map onto parameter names one to one, except for fused projections, which a
model declares in ``stacked_params``, and per-expert tensors stacked into one expert parameter,
declared as regex rules in ``stacked_param_patterns`` (see ``weir.model_interface``). Every
parameter (every shard of a fused one) must be written exactly once; anything missing,
duplicated, unexpected or of the wrong shape is an error naming the checkpoint tensors concerned.
A sharded parameter may also arrive whole (transformers' fused expert layout), which writes every
shard (into the part its module's ``whole_slice`` names, when it has one). After loading, modules
may rearrange their weights (``process_weights_after_loading``).

Every parameter takes the model dtype, except those a module names in its class attribute
``keep_fp32_params`` (a tuple of its own parameter names): they stay float32 whatever the dtype,
as transformers keeps some (``_keep_in_fp32_modules``: DeepSeek's router weight and correction
bias). Checkpoint tensors are converted to each parameter's own dtype as they are written.

With ``load_format="dummy"`` the checkpoint is not read at all: the materialised parameters are
filled with random values in place on the device (``weir.weights.dummy``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from weir.config import ModelConfig
from weir.weights.dummy import fill_dummy_weights


@dataclass
class _ParamTarget:
    parameter: nn.Parameter
    shard_ids: tuple[str | None, ...]  # (None,) for a plain parameter
    written: set[str | None] = field(default_factory=set)


def _owner_and_attr(model: nn.Module, param_name: str) -> tuple[nn.Module, str]:
    module_path, _, attr = param_name.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), attr


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """alias name -> canonical name for parameters registered under several names."""
    canonical_by_id: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in canonical_by_id:
            aliases[name] = canonical_by_id[id(param)]
        else:
            canonical_by_id[id(param)] = name
    return aliases


def _retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """``to_empty`` gives every registration its own tensor; point aliases back at one."""
    for alias, canonical in aliases.items():
        owner, attr = _owner_and_attr(model, canonical)
        alias_owner, alias_attr = _owner_and_attr(model, alias)
        setattr(alias_owner, alias_attr, getattr(owner, attr))


def _shard_ids_of(owner: nn.Module, attr: str) -> tuple[str, ...]:
    """Shards of ``owner.attr``: per parameter (``param_shard_ids``) or shared (``shard_ids``)."""
    per_param = getattr(owner, "param_shard_ids", None)
    if callable(per_param):
        return tuple(per_param(attr))
    return tuple(getattr(owner, "shard_ids", ()))


class _CheckpointMapper:
    def __init__(self, model: nn.Module, model_cls: type):
        self.model = model
        self.stacked = tuple(getattr(model_cls, "stacked_params", ()))
        self.patterns = [(re.compile(pattern), param, shard)
                         for pattern, param, shard in getattr(model_cls, "stacked_param_patterns", ())]
        self.ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_patterns", ())]
        self.aliases = _tied_aliases(model)
        self.targets: dict[str, _ParamTarget] = {}
        for name, param in model.named_parameters():
            owner, attr = _owner_and_attr(model, name)
            self.targets[name] = _ParamTarget(param, _shard_ids_of(owner, attr) or (None,))

    def map(self, checkpoint_name: str) -> tuple[str, str | None] | None:
        """(param name, shard id) for a checkpoint name; None when it is to be skipped (a tied
        alias is checked against its canonical tensor after loading instead)."""
        if checkpoint_name in self.aliases or any(p.search(checkpoint_name) for p in self.ignored):
            return None
        for pattern, param_template, shard_template in self.patterns:
            match = pattern.search(checkpoint_name)
            if match:
                param_name = checkpoint_name[: match.start()] + match.expand(param_template)
                return param_name, match.expand(shard_template)
        for fused, original, shard_id in self.stacked:
            part = f".{original}."
            if part in f".{checkpoint_name}":
                return f".{checkpoint_name}".replace(part, f".{fused}.", 1)[1:], shard_id
        return checkpoint_name, None

    def checkpoint_name(self, param_name: str, shard_id: str | None) -> str:
        """The checkpoint name that would have written this parameter (shard)."""
        owner, _ = _owner_and_attr(self.model, param_name)
        suffix_of = getattr(owner, "checkpoint_suffix", None)
        if shard_id is not None and callable(suffix_of):  # e.g. expert shards: "up.5" -> "5.up_proj.weight"
            return f"{param_name.rpartition('.')[0]}.{suffix_of(shard_id)}"
        for fused, original, stacked_shard in self.stacked:
            if stacked_shard == shard_id and f".{fused}." in f".{param_name}":
                return f".{param_name}".replace(f".{fused}.", f".{original}.", 1)[1:]
        return param_name


def checkpoint_names(model_cls: type[nn.Module], model_config: ModelConfig) -> list[str]:
    """Every checkpoint tensor name ``model_cls`` loads, tied aliases included (a model built on
    the meta device: no memory, no initialisation)."""
    with torch.device("meta"):
        model = model_cls(model_config)
    mapper = _CheckpointMapper(model, model_cls)
    names = [mapper.checkpoint_name(name, shard_id)
             for name, target in mapper.targets.items() for shard_id in target.shard_ids]
    return names + sorted(mapper.aliases)


@torch.no_grad()
def _write(model: nn.Module, target: _ParamTarget, param_name: str, shard_id: str | None,
           checkpoint_name: str, tensor: torch.Tensor) -> None:
    whole_write = shard_id is None and target.shard_ids != (None,)
    if shard_id not in target.shard_ids and not whole_write:
        shards = target.shard_ids
        listed = ", ".join(map(str, shards)) if len(shards) <= 8 else f"{len(shards)}: {shards[0]} ... {shards[-1]}"
        raise ValueError(f"checkpoint tensor {checkpoint_name} maps to shard {shard_id!r} of "
                         f"{param_name}, which has shards ({listed})")
    if shard_id in target.written or (whole_write and target.written):
        raise ValueError(f"checkpoint tensor {checkpoint_name} appears more than once")
    destination = target.parameter.data
    owner, attr = _owner_and_attr(model, param_name)
    if shard_id is not None:
        destination = destination[owner.shard_slice(shard_id)]
    elif whole_write and callable(getattr(owner, "whole_slice", None)):
        destination = destination[owner.whole_slice(attr)]  # e.g. routed experts, not the shared ones
    if tuple(destination.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {checkpoint_name} has shape {tuple(tensor.shape)}, "
                         f"but the model expects {tuple(destination.shape)} for it ({param_name})")
    # copy_ would convert integers, booleans or 8-bit floats (quantised weights, which need their
    # scales) without a word, into numbers that mean nothing.
    if destination.is_floating_point() and (not tensor.is_floating_point() or tensor.dtype.itemsize == 1):
        raise ValueError(f"checkpoint tensor {checkpoint_name} is {str(tensor.dtype).removeprefix('torch.')}; "
                         f"{param_name} takes 16- or 32-bit floats (quantised checkpoints are not supported)")
    destination.copy_(tensor)
    target.written.update(target.shard_ids if whole_write else (shard_id,))


def load_model(
    model_cls: type[nn.Module],
    model_config: ModelConfig,
    device: torch.device,
    weights: Iterable[tuple[str, torch.Tensor]],
) -> nn.Module:
    """Instantiate ``model_cls(model_config)`` on ``device`` in ``model_config.dtype`` and fill it
    from ``weights`` (ignored, and may be empty, when ``model_config.load_format == "dummy"``).

    Raises ValueError listing unexpected checkpoint tensors, or the checkpoint names of
    parameters the weights never provided.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = model_cls(model_config)
    model.to(dtype=model_config.dtype)  # on meta: free, no copy
    _keep_fp32_params(model)
    mapper = _CheckpointMapper(model, model_cls)
    model.to_empty(device=device)
    _retie(model, mapper.aliases)
    # to_empty replaced the parameters; point the targets at the live ones.
    live = dict(model.named_parameters())
    for name, target in mapper.targets.items():
        target.parameter = live[name]

    if model_config.load_format == "dummy":
        fill_dummy_weights(model)
    else:
        _write_checkpoint(model, model_cls, mapper, weights)
    for module in list(model.modules()):  # processing may replace submodules
        materialize = getattr(module, "materialize_buffers", None)
        if callable(materialize):
            materialize(device)
        process = getattr(module, "process_weights_after_loading", None)
        if callable(process):
            with torch.no_grad():
                process()
    return model.eval()


def _keep_fp32_params(model: nn.Module) -> None:
    """Back to float32 for the parameters modules list in ``keep_fp32_params`` (on meta: free)."""
    for module_name, module in model.named_modules():
        for attr in getattr(module, "keep_fp32_params", ()):
            if getattr(module, attr, False) is None:  # an optional parameter left out (a bias turned off)
                continue
            param = module._parameters.get(attr)
            if param is None:
                raise ValueError(f"{type(module).__name__}.keep_fp32_params names {attr!r}, which is not a "
                                 f"parameter of {module_name or 'the model'}")
            module._parameters[attr] = nn.Parameter(param.to(torch.float32), requires_grad=param.requires_grad)


def _write_checkpoint(model: nn.Module, model_cls: type, mapper: _CheckpointMapper,
                      weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    unexpected: list[str] = []
    tied_copies: dict[str, torch.Tensor] = {}  # alias name -> the checkpoint's own tensor for it
    for checkpoint_name, tensor in weights:
        mapped = mapper.map(checkpoint_name)
        if mapped is None:
            if checkpoint_name in mapper.aliases:
                tied_copies[checkpoint_name] = tensor
            continue
        param_name, shard_id = mapped
        target = mapper.targets.get(param_name)
        if target is None:
            unexpected.append(checkpoint_name)
            continue
        _write(model, target, param_name, shard_id, checkpoint_name, tensor)
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) {model_cls.__name__} does not "
                         f"use: {', '.join(sorted(unexpected))}")
    missing = [mapper.checkpoint_name(name, shard_id)
               for name, target in mapper.targets.items()
               for shard_id in target.shard_ids if shard_id not in target.written]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) {model_cls.__name__} needs: "
                         f"{', '.join(sorted(missing))}")
    _check_tied_copies(model, mapper.aliases, tied_copies)


def _check_tied_copies(model: nn.Module, aliases: dict[str, str], copies: dict[str, torch.Tensor]) -> None:
    """A tied parameter's own tensor in the checkpoint must equal the one it is tied to: the
    config ties them (``tie_word_embeddings``), and a different tensor means the config is wrong
    (transformers would then use the checkpoint's own, and Weir would give other outputs)."""
    parameters = dict(model.named_parameters())
    for alias, tensor in copies.items():
        canonical = parameters[aliases[alias]]
        if tuple(tensor.shape) != tuple(canonical.shape) or not torch.equal(
                tensor.to(device=canonical.device, dtype=canonical.dtype), canonical.data):
            raise ValueError(f"checkpoint tensor {alias} differs from {aliases[alias]}, but the config ties "
                             f"them (tie_word_embeddings); set tie_word_embeddings to false in config.json "
                             f"if the checkpoint's {alias} is meant to be used")
