"""The transformers config of a GGUF checkpoint, built from metadata Weir has already read.

transformers builds it with ``AutoConfig.from_pretrained(gguf_file=...)``, which parses the
whole file again with the gguf package's slow reader (seconds for a 49k-token vocabulary). For
the architectures below its recipe is one renaming table (``GGUF_CONFIG_MAPPING``, used here as
transformers ships it) plus whether the file has its own ``output.weight``; other architectures,
whose recipes carry per-family special cases, still go through transformers.
"""

from __future__ import annotations

from typing import Any

from weir.weights.gguf_file import GGUFFile

# llama.cpp architecture names whose config is the renaming table alone in transformers
# (tests/test_gguf_file.py compares the result with transformers' for each of them).
RENAMED_ONLY_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3"})


def hf_config_from_gguf(gguf_file: GGUFFile) -> Any:
    """``transformers.PretrainedConfig`` of the checkpoint; ValueError naming the file."""
    from transformers import AutoConfig

    architecture = gguf_file.architecture
    try:
        if architecture not in RENAMED_ONLY_ARCHITECTURES:
            return AutoConfig.from_pretrained(gguf_file.path.parent, gguf_file=gguf_file.path.name,
                                              local_files_only=True)
        config = AutoConfig.for_model(**_renamed_config(gguf_file))
        config._name_or_path = str(gguf_file.path.parent)  # as from_pretrained names it
        return config
    except Exception as error:  # a broken file fails anywhere in the reader (struct.error, ...)
        raise ValueError(f"cannot read the model config from {gguf_file.path}: {type(error).__name__}: "
                         f"{error}") from error


def _renamed_config(gguf_file: GGUFFile) -> dict[str, Any]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = gguf_file.architecture
    tables = {prefix: GGUF_CONFIG_MAPPING[prefix] for prefix in ("general", "tokenizer", architecture)}
    # llama.cpp leaves output.weight out when the LM head is the embedding matrix.
    config: dict[str, Any] = {
        "tie_word_embeddings": all(tensor.name != "output.weight" for tensor in gguf_file.tensors)}
    for key, value in gguf_file.metadata.items():
        prefix, _, name = key.partition(".")
        renamed = tables.get(prefix, {}).get(name)
        if renamed is not None and renamed != -1:  # None / -1: a key the table knows and drops
            config[renamed] = value
    if "vocab_size" not in config and isinstance(gguf_file.metadata.get("tokenizer.ggml.tokens"), list):
        config["vocab_size"] = len(gguf_file.metadata["tokenizer.ggml.tokens"])
    return config
