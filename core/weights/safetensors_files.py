"""Stream tensors out of a Hugging Face safetensors checkpoint folder, one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: the shards the index lists, else ``model.safetensors``."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map' listing the shard files")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard(s) missing from {folder}: "
                                    f"{', '.join(missing)}")
        return shards
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
    found = f"; it holds {', '.join(others)} but no index naming them" if others else ""
    raise FileNotFoundError(f"no safetensors checkpoint in {folder}: looked for {INDEX_FILE} "
                            f"and {SINGLE_FILE}{found}")


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint_name, tensor)`` for every tensor, on the CPU, reading lazily.

    The files are resolved now, so a folder without a checkpoint fails at the call, not later.
    """
    return _iter_files(safetensors_files(folder))


def _iter_files(paths: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                yield name, reader.get_tensor(name)
