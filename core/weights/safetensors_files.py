"""Stream tensors out of a Hugging Face safetensors checkpoint folder, one tensor at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from weir.model_files import read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: the shards the index lists, else ``model.safetensors``."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map' listing the shard files")
        names = set(weight_map.values())
        # A shard is a file name in this folder: not another type, not a path leading out of it.
        bad = sorted(map(repr, (name for name in names if not isinstance(name, str) or Path(name).name != name
                                or name in ("", ".", ".."))))
        if bad:
            raise ValueError(f"{index_path}: weight_map values must be shard file names in {folder}, "
                             f"got {', '.join(bad[:3])}")
        shards = [folder / name for name in sorted(names)]
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

    from weir.weights.progress import loading_progress

    total_bytes = sum(path.stat().st_size for path in paths)
    with loading_progress(total_bytes, f"Loading {paths[0].parent.name}", unit="B") as progress:
        for path in paths:
            for name, tensor in _iter_file(path, safe_open):
                progress.update(tensor.numel() * tensor.element_size())
                yield name, tensor


def _iter_file(path: Path, safe_open) -> Iterator[tuple[str, torch.Tensor]]:
    # safetensors raises its own SafetensorError (no path in it) for a truncated or corrupt file.
    try:
        reader = safe_open(str(path), framework="pt", device="cpu")
        names = list(reader.keys())
    except Exception as error:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") \
            from error
    with reader:
        for name in names:
            try:
                tensor = reader.get_tensor(name)
            except Exception as error:
                raise ValueError(f"{path}: cannot read tensor {name} (truncated or corrupt file?): "
                                 f"{error}") from error
            yield name, tensor
