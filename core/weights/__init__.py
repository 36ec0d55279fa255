"""Checkpoint readers and the model loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from weir.config import ModelConfig


def iter_checkpoint(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint_name, tensor)`` pairs in HF naming, from a .gguf file or a safetensors folder;
    nothing for ``load_format="dummy"``, whose weights the loader makes up on the device."""
    if model_config.load_format == "dummy":
        return iter(())
    if model_config.is_gguf:
        from weir.weights.gguf import iter_gguf

        return iter_gguf(model_config)
    from weir.weights.safetensors_files import iter_safetensors

    folder = model_config.weights_path
    try:
        return iter_safetensors(folder)
    except FileNotFoundError as error:
        if any(folder.glob("*.safetensors*")):
            raise  # a broken checkpoint, not a config-only folder: the reader's message says why
        raise FileNotFoundError(
            f"no checkpoint in {folder}: it holds config.json but no weights (no *.safetensors). "
            f"To run this config with random weights (benchmarks), pass load_format='dummy' "
            f"(--load-format dummy)") from error
