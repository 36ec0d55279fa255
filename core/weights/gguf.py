"""Read a GGUF checkpoint as HF-named, dequantised tensors.

llama.cpp renames tensors (``blk.0.attn_q.weight``) and permutes the q/k rows of some families
for its rotary layout. Rather than re-derive that, this module asks transformers: its GGUF
tensor processors undo the per-family changes, and the gguf package's name map (the same one
transformers uses) gives the HF name of every tensor. Tensors are dequantised one at a time, so
peak host memory is one tensor, not the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# GGUF tensors with no HF parameter that transformers drops too: llama.cpp's precomputed rotary
# frequencies, which HF recomputes from the config. Any other unmatched tensor is an error, as an
# unexpected tensor in a safetensors checkpoint is.
DROPPED_GGUF_TENSORS = frozenset({"rope_freqs.weight"})


def iter_gguf(model_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight in ``model_config.weights_path`` (a .gguf file).

    Tensors come out in ``model_config.dtype`` on the CPU. A tied ``lm_head.weight`` is not
    yielded when the file has no ``output.weight`` (the model ties it to the embeddings). The
    header comes from ``model_config.gguf`` when the config read it already.
    """
    from gguf import GGMLQuantizationType, dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from weir.weights.gguf_file import GGUFFile
    from weir.weights.progress import loading_progress

    path = model_config.weights_path
    gguf_file = model_config.gguf if getattr(model_config, "gguf", None) is not None else GGUFFile.read(path)
    hf_config = model_config.hf_config
    processor = TENSOR_PROCESSORS.get(gguf_file.architecture, TensorProcessor)(config=hf_config.to_dict())
    name_map = _gguf_to_hf_names(hf_config, processor, _weir_checkpoint_names(model_config))
    # Processors that merge several GGUF tensors into one HF tensor (MoE experts) stash the
    # merged result here instead of returning it.
    merged: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}
    unexpected = []
    tensors = gguf_file.tensor_arrays()
    with loading_progress(len(tensors), f"Loading {path.name}") as progress:
        for info, data in tensors:
            try:
                weights = dequantize(data, GGMLQuantizationType(info.ggml_type))
            except Exception as error:  # NotImplementedError for quantisations gguf cannot unpack, ...
                raise ValueError(f"{path}: cannot dequantise tensor {info.name} of type "
                                 f"{GGMLQuantizationType(info.ggml_type).name}: {error}") from error
            result = processor.process(weights=weights, name=info.name,
                                       tensor_key_mapping=name_map, parsed_parameters=merged)
            progress.update(1)
            if result.name is None:
                continue
            if result.name not in name_map:
                if result.name in DROPPED_GGUF_TENSORS:
                    logger.info("GGUF tensor %s has no HF counterpart (HF recomputes it): not loaded", result.name)
                else:
                    unexpected.append(result.name)
                continue
            yield name_map[result.name], _to_torch(result.weights, model_config.dtype)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        raise ValueError(f"{path} holds tensors the {model_config.architecture} model has no place for: {shown}")
    for hf_name, tensor in merged["tensors"].items():
        yield hf_name, tensor.to(model_config.dtype)


def _to_torch(weights: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # Unquantised tensors come back as read-only views of the memory-mapped file.
    array = weights if weights.flags.writeable else np.array(weights)
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


class _ModuleNames:
    """The parameter names of an HF model, shaped like the module transformers' name mapper walks.

    transformers' mapper recurses into every submodule and rebuilds the gguf name table at each
    one (seconds for a 30-layer model). Only the top level and its direct children matter (a
    GGUF converted from the bare ``XModel`` lacks the ``model.`` prefix), so expose just those.
    """

    def __init__(self, config: Any, names: list[str], children: dict[str, list[str]] | None):
        self.config = config
        self._names = names
        self._children = children

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self) -> list[tuple[str, "_ModuleNames"]]:
        if self._children is None:
            return []
        return [(name, _ModuleNames(self.config, child_names, None))
                for name, child_names in self._children.items()]


def _weir_checkpoint_names(model_config: Any) -> list[str] | None:
    """The HF tensor names Weir's own model of this architecture loads, or None when no plugin
    serves it here. They name the GGUF tensors as transformers' model's state dict would, without
    importing transformers' modeling code for it (over a second of imports at every start)."""
    from weir.plugin_manager import load_plugins
    from weir.weights.loader import checkpoint_names

    registry = load_plugins()
    if model_config.architecture not in registry.models:
        return None
    return checkpoint_names(registry.resolve_model(model_config.architecture), model_config)


def _gguf_to_hf_names(hf_config: Any, processor: Any, names: list[str] | None = None) -> dict[str, str]:
    """``{gguf_name: hf_name}`` for ``names`` (HF checkpoint names), by default the state dict of
    the HF causal-LM class of ``hf_config``."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    if names is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # names only: no memory, no init cost
            names = list(AutoModelForCausalLM.from_config(hf_config).state_dict())
    children: dict[str, list[str]] = {}
    for name in names:
        if "." in name:
            child, rest = name.split(".", 1)
            children.setdefault(child, []).append(rest)
    return get_gguf_hf_weights_map(_ModuleNames(hf_config, names, children), processor)
