"""Resolve what the user named (a checkpoint folder, a .gguf file, or nothing) into model files.

Weir never downloads a checkpoint: the one exception is its built-in default model, fetched
once into the cache by ``weir.default_model``. Everything else must already be on disk.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weir import default_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    display_name: str  # what the user named, or the default model's name
    weights_path: Path  # checkpoint folder, or the .gguf file
    tokenizer_path: Path  # tokenizer folder, or the .gguf file that carries the tokenizer
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str  # e.g. "LlamaForCausalLM"
    eos_token_ids: tuple[int, ...]
    chat_template: str | None  # a template shipped beside the weights but outside the tokenizer
    gguf: Any = None  # weir.weights.gguf_file.GGUFFile: the .gguf weights' header, parsed once


def resolve_model_files(model: str | None, tokenizer: str | None) -> ModelFiles:
    """Find the weights, config, tokenizer and end-of-sequence ids for ``model``."""
    path = Path(model).expanduser() if model is not None else None
    # A local folder that happens to carry the default model's name is still a local folder.
    if path is None or (model == default_model.DEFAULT_MODEL_NAME and not path.exists()):
        return _default_model_files(tokenizer)
    if not path.exists():
        raise FileNotFoundError(_missing_model_message(model))
    gguf_file = _gguf_file_in(path)
    gguf = None
    if gguf_file is not None:
        gguf, hf_config = _load_gguf_config(gguf_file)
        weights_path = gguf_file
    else:
        hf_config = _load_folder_config(path)
        weights_path = path
    tokenizer_path = _tokenizer_path(tokenizer, default=weights_path)
    eos_ids = _merge_eos_ids(
        _generation_config_eos(weights_path),
        _as_id_list(getattr(hf_config, "eos_token_id", None), f"eos_token_id in the config of {weights_path}"),
        _tokenizer_eos(tokenizer_path, weights_path),
    )
    return ModelFiles(
        display_name=model, weights_path=weights_path, tokenizer_path=tokenizer_path,
        hf_config=hf_config, architecture=_architecture(hf_config, weights_path),
        eos_token_ids=eos_ids, chat_template=_side_chat_template(weights_path, tokenizer_path), gguf=gguf,
    )


def model_context_length(model: str | None) -> int:
    """The context length ``model`` declares (``max_position_embeddings``, or a GGUF's
    ``<arch>.context_length``), read from its config file or GGUF header alone, without building
    its config; 4096, as the engine assumes, when it declares none. Errors are left to the engine,
    which reports them in full when it starts."""
    path = Path(model).expanduser() if model is not None else None
    try:
        if path is None or (model == default_model.DEFAULT_MODEL_NAME and not path.exists()):
            path = default_model.ensure_default_model()
        gguf_file = _gguf_file_in(path)
        if gguf_file is not None:
            from weir.weights.gguf_file import GGUFFile

            metadata = GGUFFile.read(gguf_file).metadata
            declared = metadata.get(f"{metadata.get('general.architecture')}.context_length")
        else:
            declared = read_json_object(path / "config.json").get("max_position_embeddings")
    except (OSError, ValueError):
        return _ASSUMED_CONTEXT_LENGTH
    return declared if _is_token_id(declared) and declared > 0 else _ASSUMED_CONTEXT_LENGTH


def has_tokenizer_files(model: str) -> bool:
    """Whether ``model`` carries a tokenizer: a GGUF always does; a folder when it holds one of
    the files transformers builds a tokenizer from."""
    from weir.tokenizer import TOKENIZER_FILES

    path = Path(model).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        return True  # a .gguf file, a folder of one, or an error the engine reports
    return any((path / name).is_file() for name in TOKENIZER_FILES)


# What the engine takes a model that declares no context length to have (weir.config).
_ASSUMED_CONTEXT_LENGTH = 4096


def _missing_model_message(model: str) -> str:
    message = (f"model path {model!r} does not exist. Weir loads only local checkpoints (an HF "
               f"folder with config.json, or a .gguf file) and does not download checkpoints")
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id:
        message += f"; fetch it first (e.g. `hf download {model} --local-dir DIR`) and pass DIR"
    return message + "."


def _default_model_files(tokenizer: str | None) -> ModelFiles:
    gguf_file = default_model.ensure_default_model()
    gguf, hf_config = _load_gguf_config(gguf_file)
    return ModelFiles(
        display_name=default_model.DEFAULT_MODEL_NAME, weights_path=gguf_file,
        tokenizer_path=_tokenizer_path(tokenizer, default=gguf_file), hf_config=hf_config,
        architecture=_architecture(hf_config, gguf_file),
        # The GGUF metadata names <|im_start|> as eos in some transformers versions; the
        # chat model ends its turns with <|im_end|>, and that is the only stop we want.
        eos_token_ids=(default_model.DEFAULT_MODEL_EOS_TOKEN_ID,), chat_template=None, gguf=gguf,
    )


def _gguf_file_in(path: Path) -> Path | None:
    """The .gguf file ``path`` names or holds alone; None for an HF checkpoint folder."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model path {str(path)!r} is a file but not a .gguf file; pass an HF "
                             f"checkpoint folder (with config.json) or a .gguf file")
        return path
    if (path / "config.json").is_file():
        return None
    gguf_files = sorted(path.glob("*.gguf"))
    if len(gguf_files) == 1:
        return gguf_files[0]
    if not gguf_files:
        raise FileNotFoundError(f"model folder {str(path)!r} holds neither config.json nor a .gguf "
                                f"file; is it a checkpoint folder?")
    names = ", ".join(file.name for file in gguf_files)
    raise ValueError(f"model folder {str(path)!r} holds several .gguf files ({names}) and no "
                     f"config.json; pass the one to load as the model path")


def _load_gguf_config(gguf_file: Path) -> tuple[Any, Any]:
    """``(GGUFFile, transformers config)``: the header is parsed here once, and the weights and
    the tokenizer are read from it later."""
    from weir.weights.gguf_config import hf_config_from_gguf
    from weir.weights.gguf_file import GGUFFile

    gguf = GGUFFile.read(gguf_file)
    return gguf, hf_config_from_gguf(gguf)


def _load_folder_config(folder: Path) -> Any:
    from transformers import AutoConfig

    config_file = folder / "config.json"
    content = read_json_object(config_file)  # a clear error naming the file beats transformers' generic one
    _check_model_type_known(content.get("model_type"), config_file)
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # field type checks, a zero head count, a bogus torch_dtype, ...
        raise ValueError(f"cannot read the model config {config_file}: {type(error).__name__}: {error}") \
            from error


def _check_model_type_known(model_type: Any, config_file: Path) -> None:
    """An unknown ``model_type`` gets transformers' "upgrade transformers" advice, which misleads:
    Weir runs its own model code, so say what it serves instead."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING_NAMES:
        return  # no model_type: transformers' own message names the missing field
    from weir.plugin_manager import load_plugins

    architectures = ", ".join(sorted(load_plugins().models))
    raise ValueError(f"{config_file} has model_type {model_type!r}, which neither Weir nor the transformers it reads "
                     f"configs with knows. Weir serves these architectures (config.json `architectures`): "
                     f"{architectures}; a model plugin adds others (`weir plugins` lists what is registered)")


def read_json_object(file: Path) -> dict:
    """A JSON file's top-level object; errors name the file."""
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(content, dict):
        raise ValueError(f"{file} must hold a JSON object, found {type(content).__name__}")
    return content


def _architecture(hf_config: Any, weights_path: Path) -> str:
    architectures = getattr(hf_config, "architectures", None)
    if architectures:
        if not isinstance(architectures, (list, tuple)) or not isinstance(architectures[0], str):
            raise ValueError(f"the config of {weights_path} has architectures={architectures!r}; it must be "
                             f'a list of class names, e.g. ["LlamaForCausalLM"]')
        return architectures[0]
    # GGUF-derived configs carry no `architectures`; the model type names the causal-LM class.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", None)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if architecture is None:
        raise ValueError(f"the config of {weights_path} names no `architectures`, and its model_type "
                         f"{model_type!r} has no causal-LM class in transformers; add "
                         f'"architectures": ["<Name>ForCausalLM"] to its config.json')
    return architecture


def _tokenizer_path(tokenizer: str | None, default: Path) -> Path:
    if tokenizer is None:
        return default
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {tokenizer!r} does not exist; pass a local tokenizer "
                                f"folder or .gguf file (Weir does not download tokenizers)")
    return path


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _as_id_list(value: Any, where: str) -> list[int]:
    """A token id or a list of them; ``where`` names the file and field for the error."""
    if value is None:
        return []
    if _is_token_id(value):
        return [value]
    if isinstance(value, list) and all(_is_token_id(token_id) for token_id in value):
        return list(value)
    raise ValueError(f"{where} must be a token id or a list of token ids, got {value!r}")


def _merge_eos_ids(*id_lists: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(token_id for ids in id_lists for token_id in ids))


def _generation_config_eos(weights_path: Path) -> list[int]:
    file = weights_path / "generation_config.json"
    if not weights_path.is_dir() or not file.is_file():
        return []
    return _as_id_list(read_json_object(file).get("eos_token_id"), f"eos_token_id in {file}")


# generation_config.json key -> SamplingParams field: the values vLLM applies by default.
GENERATION_CONFIG_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                              "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                              "max_new_tokens": "max_tokens"}


def generation_config_sampling(folder: Path) -> tuple[tuple[str, float | int], ...]:
    """The sampling values ``folder/generation_config.json`` recommends, as (SamplingParams field,
    value) pairs (none when there is no such file). A value SamplingParams would refuse (a string,
    ``top_p: 0`` beside ``do_sample: false``) is skipped with a warning naming the file: the file
    is advice, and transformers loads such checkpoints."""
    from weir.sampling_params import SamplingParams

    file = folder / "generation_config.json"
    if not folder.is_dir() or not file.is_file():
        return ()
    values = read_json_object(file)
    defaults = []
    for key, field_name in GENERATION_CONFIG_SAMPLING.items():
        value = values.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{field_name: value})
        except (TypeError, ValueError) as error:
            logger.warning("%s: %s is not used as a sampling default (%s)", file, key, error)
            continue
        defaults.append((field_name, value))
    return tuple(defaults)


def _tokenizer_eos(tokenizer_path: Path, weights_path: Path) -> list[int]:
    """The tokenizer's eos id, read from its files so the tokenizer is loaded only once, later."""
    if tokenizer_path.is_dir():
        return _folder_tokenizer_eos(tokenizer_path)
    if tokenizer_path == weights_path:
        return []  # a GGUF's tokenizer eos is the config eos already read from the same metadata
    from weir.weights.gguf_file import GGUFFile

    return _as_id_list(GGUFFile.read(tokenizer_path).metadata.get("tokenizer.ggml.eos_token_id"),
                       f"tokenizer.ggml.eos_token_id in {tokenizer_path}")


def _folder_tokenizer_eos(folder: Path) -> list[int]:
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return []
    tokenizer_config = read_json_object(config_file)
    eos_token = tokenizer_config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if not isinstance(eos_token, str):
        return []
    decoder = tokenizer_config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict) or not all(isinstance(token, dict) for token in decoder.values()):
        raise ValueError(f"added_tokens_decoder in {config_file} must map token ids to token objects")
    for token_id, token in decoder.items():
        if token.get("content") == eos_token:
            return [_parse_token_id(token_id, f"added_tokens_decoder key for {eos_token!r} in {config_file}")]
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        return []
    text = tokenizer_file.read_text(encoding="utf-8")
    for token in _leading_added_tokens(text) or []:
        if token.get("content") == eos_token:
            return [_parse_token_id(token.get("id"), f"the id of {eos_token!r} in {tokenizer_file}")]
    tokenizer_json = read_json_object(tokenizer_file)
    added = tokenizer_json.get("added_tokens", [])
    if not isinstance(added, list) or not all(isinstance(token, dict) for token in added):
        raise ValueError(f"added_tokens in {tokenizer_file} must be a list of token objects")
    for token in added:
        if token.get("content") == eos_token:
            return [_parse_token_id(token.get("id"), f"the id of {eos_token!r} in {tokenizer_file}")]
    model = tokenizer_json.get("model", {})
    vocab = model.get("vocab", {}) if isinstance(model, dict) else {}
    if isinstance(vocab, dict) and eos_token in vocab:
        return [_parse_token_id(vocab[eos_token], f"the id of {eos_token!r} in {tokenizer_file}")]
    return []


def _leading_added_tokens(text: str) -> list[dict] | None:
    """The ``added_tokens`` list of a tokenizer.json, decoded alone. The special tokens (eos among
    them) sit there, ahead of a vocabulary and merges of tens of MB: Qwen's 19 MB file took a
    second to parse whole, on every start. None when the list is not where tokenizers writes it
    (the caller then parses the whole file)."""
    key = text.find('"added_tokens"', 0, 4096)  # tokenizers writes it among the first keys
    if key < 0:
        return None
    colon = text.find(":", key)
    start = colon + 1 + len(text[colon + 1:colon + 65]) - len(text[colon + 1:colon + 65].lstrip())
    try:
        added, _ = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    if not isinstance(added, list) or not all(isinstance(token, dict) for token in added):
        return None
    return added


def _parse_token_id(value: Any, where: str) -> int:
    """A token id written as an int or a decimal string (JSON object keys are strings)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if _is_token_id(value):
        return value
    raise ValueError(f"{where} must be a token id, got {value!r}")


def _side_chat_template(weights_path: Path, tokenizer_path: Path) -> str | None:
    """A chat template in the checkpoint folder, when the tokenizer comes from elsewhere.

    A tokenizer loaded from the checkpoint folder picks up that template itself.
    """
    if not weights_path.is_dir() or tokenizer_path == weights_path:
        return None
    template_file = weights_path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    json_file = weights_path / "chat_template.json"
    if json_file.is_file():
        template = read_json_object(json_file).get("chat_template")
        return template if isinstance(template, str) else None
    return None
