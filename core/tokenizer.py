"""Tokenizer loading, chat templates and prompt encoding, all through transformers."""

from __future__ import annotations

import json
import os
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

from weir.no_tokenizer import NoTokenizer, tokenizer_required_message


# The files transformers builds a tokenizer from (fast, then slow ones).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def load_tokenizer(model_config: Any) -> Any:
    """Load the transformers tokenizer from ``model_config.tokenizer_path`` (folder or .gguf file);
    a ``NoTokenizer`` under ``skip_tokenizer_init``."""
    if getattr(model_config, "skip_tokenizer_init", False):
        return NoTokenizer()
    from transformers import AutoTokenizer

    path = model_config.tokenizer_path
    try:
        if path.suffix == ".gguf":
            tokenizer_class = _gguf_tokenizer_class(model_config) or AutoTokenizer
            return tokenizer_class.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **_mistral_regex_options(path))
    except (OSError, ValueError, KeyError) as error:
        hint = ""
        if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
            hint = (f" (the folder holds none of {', '.join(TOKENIZER_FILES)}: copy the model's tokenizer there "
                    f"or name another with the tokenizer option; or pass skip_tokenizer_init (--skip-tokenizer-init) "
                    f"to run on token ids alone)")
        raise ValueError(f"cannot load a tokenizer from {path}{hint}: {error}") from error


# The model types whose tokenizers transformers' Mistral pre-tokenizer regex check is about.
MISTRAL_MODEL_TYPES = frozenset({"mistral", "mistral3", "voxtral", "ministral", "pixtral"})


def _mistral_regex_options(folder: Path) -> dict[str, bool]:
    """``fix_mistral_regex=False`` for a tokenizer folder whose config.json names a model type that
    is not Mistral's. transformers (5.17 among others) checks every tokenizer of over 100k tokens
    for a faulty Mistral regex, and takes a config.json without ``transformers_version`` (the
    Qwen3 configs in benchmarks/models, say) for a Mistral one: it then warns "incorrect regex
    pattern" on every start. Saying False, as its warning asks, is what it concludes itself for
    any other model type; Mistral models and folders without a config keep its check."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return {}
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError):  # not JSON, or not an object: transformers' check decides
        return {}
    if not isinstance(model_type, str) or model_type in MISTRAL_MODEL_TYPES:
        return {}
    return {"fix_mistral_regex": False}


def _gguf_tokenizer_class(model_config: Any) -> type | None:
    """The class ``AutoTokenizer`` picks for the model's own .gguf file, or None to let it pick.

    ``AutoTokenizer`` first rebuilds the model config from the file, with the gguf package's slow
    reader (seconds for a 49k vocabulary), only to choose the class: for a GGUF with no
    tokenizer_config.json beside it that is the model type's registered tokenizer, else
    ``TokenizersBackend``. The engine has that config already, so choose here.
    """
    path = model_config.tokenizer_path
    if path != getattr(model_config, "weights_path", None) or (path.parent / "tokenizer_config.json").exists():
        return None  # another file, or a folder whose tokenizer_config.json may name the class
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers without the v5 tokenizer classes: let AutoTokenizer choose
        return None
    registered = TOKENIZER_MAPPING_NAMES.get(getattr(model_config.hf_config, "model_type", None))
    if not registered:
        return TokenizersBackend
    return tokenizer_class_from_name(registered if isinstance(registered, str) else registered[-1])


def start_loading_tokenizer(model_config: Any, pool: Executor) -> Future:
    """``load_tokenizer`` in ``pool`` (beside the model's load). transformers' lazy top-level names
    are not safe to resolve from two threads at once: ``AutoTokenizer`` is resolved here first."""
    if getattr(model_config, "skip_tokenizer_init", False):  # nothing to load: no transformers import either
        done: Future = Future()
        done.set_result(NoTokenizer())
        return done
    from transformers import AutoTokenizer  # noqa: F401

    return pool.submit(load_tokenizer, model_config)


class UnsupportedContent(ValueError):
    """A message part a chat template cannot take (an image, ...); ``param`` names where it is."""

    def __init__(self, param: str, what: str):
        super().__init__(f"{param}: {what} is not supported")
        self.param, self.what = param, what


def template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An OpenAI-style message as chat templates expect it, as vLLM prepares it: text content
    parts joined by newlines, ``developer`` as ``system``, and tool-call arguments given as a JSON
    string turned into an object (Qwen2.5, Hermes and Llama 3.1 templates render them with
    ``tojson``, which would encode a string a second time)."""
    prepared = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedContent(f"messages.{index}.content.{part_index}.type",
                                         f"content part type {part_type!r} (only 'text')")
            texts.append(part["text"])
        prepared["content"] = "\n".join(texts)
    elif content is None:
        prepared["content"] = ""
    if prepared.get("role") == "developer":
        prepared["role"] = "system"
    if isinstance(message.get("tool_calls"), list):
        prepared["tool_calls"] = [_arguments_as_object(call) for call in message["tool_calls"]]
    return prepared


def _arguments_as_object(tool_call: Any) -> Any:
    function = tool_call.get("function") if isinstance(tool_call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return tool_call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):  # not JSON, an integer past int()'s digit limit, nested too deep
        return tool_call
    if not isinstance(arguments, dict):
        return tool_call
    return {**tool_call, "function": {**function, "arguments": arguments}}


def render_chat_template(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         template_kwargs: dict[str, Any] | None = None,
                         tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of ``messages`` (prepared by ``template_message``) and the ``tools`` the model
    may call, by the override template (or the tokenizer's own); ``template_kwargs`` are extra
    template variables (``enable_thinking`` for Qwen3, ...)."""
    if isinstance(tokenizer, NoTokenizer):
        raise ValueError(tokenizer_required_message("a chat request (its chat template) needs"))
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template, so chat requests cannot be rendered; pass "
                         "one with --chat-template FILE (a Jinja template), or use plain completions")
    import jinja2

    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **(template_kwargs or {}))
    except jinja2.TemplateError as error:  # raise_exception(...) in the template, or a syntax error
        raise ValueError(f"the chat template cannot render these messages: {error}") from error
    return text


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """``render_chat_template``'s text as token ids."""
    text = render_chat_template(tokenizer, messages, chat_template, add_generation_prompt, continue_final_message,
                                template_kwargs, tools)
    return encode_rendered_chat(tokenizer, text)


def encode_rendered_chat(tokenizer: Any, text: str) -> list[int]:
    # Without special tokens: the template writes any BOS itself, and this returns plain ids the
    # same way across transformers versions.
    return tokenizer.encode(text, add_special_tokens=False)


def load_chat_template(value: str) -> str:
    """The ``--chat-template`` override: a file's contents, or the value itself when it is a Jinja
    template; checked to parse as transformers compiles it, so a broken one fails at start-up."""
    if os.path.isfile(value):
        template = Path(value).read_text()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"chat_template {value!r} is neither a file that exists nor a Jinja template "
                         "(no '{{' or '{%' in it)")
    try:  # transformers' own compiler (its extensions included); private, so skipped if it moves
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return template
    import jinja2

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat_template has a Jinja syntax error at line {error.lineno}: {error.message}") from error
    return template


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Encode a completion prompt as HF does by default (the tokenizer adds BOS if it should)."""
    return tokenizer.encode(text, add_special_tokens=True)
