"""Checkpoint readers and the model loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from weir.config import ModelConfig


def iter_checkpoint(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint_name, tensor)`` pairs in HF naming, from a .gguf file or a safetensors folder."""
    if model_config.is_gguf:
        from weir.weights.gguf import iter_gguf

        return iter_gguf(model_config)
    from weir.weights.safetensors_files import iter_safetensors

    return iter_safetensors(model_config.weights_path)
