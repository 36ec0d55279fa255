"""Engine configuration: user options in, frozen config dataclasses out, built in one place.

``EngineArgs`` holds the options as the user gives them (the CLI flags map 1:1 onto its
fields, and ``weir.LLM(**options)`` takes the same names). ``EngineArgs.create_config()``
reads the checkpoint's HF config and returns an ``EngineConfig``; nothing writes back into
either afterwards (runtime facts such as the number of KV blocks live in the runner).

torch is imported only where a dtype is made: the CLI builds its flags from ``EngineArgs``, and
``weir --help`` must not wait for torch.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weir.spec_decode.config import PER_REQUEST_METRICS_LEVELS, SpeculativeConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Every dtype name users may give -> the torch dtype's attribute name.
_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype a user's dtype name (a key of ``_DTYPES``) means."""
    import torch

    return getattr(torch, _DTYPES[name])


def _float32() -> "torch.dtype":
    return torch_dtype("float32")


# vLLM's names (any case). Weir's graphs hold whole steps: vLLM's default full_and_piecewise (full
# decode graphs, piecewise mixed ones) means full here, and piecewise alone is not offered.
CUDAGRAPH_MODES = ("full", "full_decode_only", "none")
_CUDAGRAPH_ALIASES = {"full_and_piecewise": "full"}


def _cudagraph_mode(value: str) -> str:
    mode = value.lower()
    return _CUDAGRAPH_ALIASES.get(mode, mode)

# "safetensors" and "gguf" as vLLM spells them: the same as "auto", checked against what is there.
_LOAD_FORMATS = ("auto", "dummy", "safetensors", "gguf")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user named: a folder, a .gguf file, or the default model's name
    weights_path: Path  # checkpoint folder, or the .gguf file
    tokenizer_path: Path
    architecture: str
    hf_config: Any  # transformers.PretrainedConfig; read-only by convention
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    served_model_name: str
    chat_template: str | None = None  # overrides the tokenizer's own template when set
    load_format: str = "auto"  # "auto" (safetensors or gguf by what is there)
    # SamplingParams values for fields a request leaves out (the checkpoint's generation_config)
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts in, token ids out, empty text
    # The .gguf weights' header (weir.weights.gguf_file.GGUFFile), parsed once while the config is
    # read, so the weights and the tokenizer need not parse the file again; None otherwise.
    gguf: Any = field(default=None, repr=False, compare=False)

    @property
    def is_gguf(self) -> bool:
        return self.weights_path.suffix == ".gguf"

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None  # None: size from the platform's free memory
    gpu_memory_utilization: float
    # recurrent states of linear-attention layers
    linear_state_dtype: torch.dtype = field(default_factory=_float32)
    # which prefix-cache entries windowed groups and linear-attention checkpoints keep (weir.kv_cache.retention)
    prefix_cache_retention_interval: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    async_scheduling: bool  # prepare step N+1 while step N runs; stops apply one step late


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str | None  # platform name forced by the user, or None for auto-detection
    attention_backend: str | None
    moe_backend: str | None
    seed: int
    max_logprobs: int
    enforce_eager: bool
    cudagraph_mode: str  # one of CUDAGRAPH_MODES: which steps run in CUDA graphs where graphs run
    # Speculative decoding (weir.spec_decode): None, or what the user asked; the draft's config for
    # methods with a draft checkpoint; how much of it responses report.
    speculative: Any = None  # weir.spec_decode.config.SpeculativeConfig
    draft_model: ModelConfig | None = None
    per_request_spec_decode_metrics: str = "none"


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class EngineArgs:
    """Every engine option, named as vLLM names it. CLI flags are generated from these fields."""

    model: str | None = field(default=None, metadata=_help(
        "HF checkpoint folder or .gguf file; default: the built-in SmolLM2-135M-Instruct"))
    tokenizer: str | None = field(default=None, metadata=_help("tokenizer folder (default: the model's)"))
    skip_tokenizer_init: bool = field(default=False, metadata=_help(
        "load no tokenizer: prompts must be token ids, outputs carry token ids and empty text (serves and "
        "benchmarks a checkpoint that has no tokenizer files); text prompts, chat and stop strings are refused"))
    served_model_name: str | None = field(default=None, metadata=_help("model name reported to clients"))
    chat_template: str | None = field(default=None, metadata=_help("Jinja chat template file or string"))
    generation_config: str = field(default="auto", metadata=_help(
        "auto: the checkpoint's generation_config.json sampling values (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens) are the defaults of requests that set none, as vLLM does; a "
        "folder: its generation_config.json instead; none (or vllm): Weir's own defaults"))
    load_format: str = field(default="auto", metadata=_help(
        "auto: the checkpoint's weights; dummy: random weights, config.json alone suffices (benchmarks); "
        "safetensors / gguf: as auto, for a checkpoint of that kind (as vLLM)"))
    device: str | None = field(default=None, metadata=_help("platform: cpu, cuda, rocm, xpu (default: detect)"))
    dtype: str = field(default="auto", metadata=_help("auto, float32, bfloat16, float16"))
    max_model_len: int | None = field(default=None, metadata=_help("context length (default: the model's)"))
    max_num_seqs: int | None = field(default=None, metadata=_help(
        "requests in one batch at most (default: 256 on CPU, 1024 otherwise)"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_help(
        "tokens in one step at most (default: 8192 on CPU, 16384 otherwise)"))
    block_size: int = field(default=16, metadata=_help("tokens per KV cache block"))
    enable_prefix_caching: bool = field(default=True, metadata=_help("reuse KV of shared prompt prefixes"))
    prefix_cache_retention_interval: int = field(default=0, metadata=_help(
        "where the prefix cache keeps what sliding-window and linear-attention layers need to resume (window "
        "blocks, state checkpoints), in tokens, a multiple of block_size: 0 (as vLLM) keeps each prompt's last "
        "block boundary and the points where prompts sharing a prefix diverge; N: every N tokens of a prompt and "
        "its last block boundary (block_size: every block)"))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=_help(
        "KV cache size in bytes (default: from free memory)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "fraction of accelerator memory Weir may use"))
    linear_state_dtype: str = field(default="float32", metadata=_help(
        "dtype of linear-attention recurrent states: float32 (as transformers keeps them), or bfloat16 / "
        "float16 for half their memory and traffic (vLLM keeps them in the model dtype)"))
    async_scheduling: bool = field(default=True, metadata=_help(
        "schedule the next step while the current one runs"))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "devices to shard the model over; only 1: tensor parallelism is not implemented yet"))
    attention_backend: str | None = field(default=None, metadata=_help(
        "attention backend, or several separated by commas (e.g. triton,gdn_torch); each serves the layer "
        "kinds it supports, the platform's defaults serve the rest"))
    moe_backend: str | None = field(default=None, metadata=_help("MoE backend (default: platform's)"))
    seed: int = field(default=0, metadata=_help("seed for requests that set none"))
    max_logprobs: int = field(default=20, metadata=_help("most top logprobs a request may ask for"))
    enforce_eager: bool = field(default=False, metadata=_help("no graphs"))
    cudagraph_mode: str = field(default="full", metadata=_help(
        "which steps replay CUDA graphs, named as vLLM's compilation_config.cudagraph_mode: full (decode steps, and "
        "mixed prefill steps of up to 2048 tokens where every backend allows it; full_and_piecewise means the "
        "same), full_decode_only, none"))
    speculative_config: dict | str | None = field(default=None, metadata={**_help(
        "speculative decoding as a JSON object, named as vLLM names it: method (ngram, draft_model, eagle, eagle3, "
        "mtp), num_speculative_tokens, prompt_lookup_max/min (ngram), model (draft checkpoint), "
        "disable_by_batch_size; Weir's adaptive (true) and verification_cost (0.1)"), "json": True})
    per_request_spec_decode_metrics: str = field(default="none", metadata=_help(
        "none, summary or detailed: add each request's speculative-decoding acceptance (vLLM's "
        "metrics.speculative_decoding object) to chat and completion responses; detailed adds every step's counts"))
    disable_log_requests: bool = field(default=False, metadata=_help(
        "accepted so vLLM command lines run: Weir writes no log line per request, so there is nothing to turn off"))
    trust_remote_code: bool = field(default=False, metadata=_help(
        "accepted so vLLM command lines run; Weir never runs a checkpoint's own code (its models are plugins)"))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> "EngineArgs":
        unknown = set(options) - cls.field_names()
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(cls.field_names()))}")
        return cls(model=model, **options)

    def _sampling_defaults(self, weights_path: Path) -> tuple[tuple[str, float | int], ...]:
        from weir.model_files import generation_config_sampling

        from weir import default_model

        if self.generation_config in ("none", "vllm"):  # vllm: vLLM's spelling of "ignore the file"
            return ()
        if self.generation_config == "auto" and default_model.is_default_model_file(weights_path):
            return default_model.DEFAULT_MODEL_SAMPLING_DEFAULTS  # its GGUF carries none
        folder = weights_path if self.generation_config == "auto" else Path(self.generation_config)
        return generation_config_sampling(folder)

    def create_config(self, platform_device_type: str = "cpu") -> EngineConfig:
        from weir.model_files import resolve_model_files
        from weir.tokenizer import load_chat_template

        self._validate()
        speculative = SpeculativeConfig.from_user(self.speculative_config)
        if self.trust_remote_code:
            logger.warning("trust_remote_code has no effect: Weir runs its own model code (plugins), never a "
                           "checkpoint's")
        chat_template = None if self.chat_template is None else load_chat_template(self.chat_template)
        files = resolve_model_files(self.model, self.tokenizer)
        _check_load_format(self.load_format, files.weights_path)
        hf_config = files.hf_config
        architecture = files.architecture
        _check_unquantized(hf_config, files.display_name, self.load_format)
        dtype = _resolve_dtype(self.dtype, hf_config, platform_device_type)
        model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 4096
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len={max_model_len} is longer than the model's "
                             f"max_position_embeddings={model_max}")
        vocab_size = getattr(hf_config, "vocab_size", None)
        outside = [t for t in files.eos_token_ids if isinstance(vocab_size, int) and not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"{files.display_name}: end-of-sequence token ids {outside} lie outside the vocabulary "
                             f"[0, {vocab_size}): fix eos_token_id in its config.json or generation_config.json")
        default_tokens = 8192 if platform_device_type == "cpu" else 16384
        max_num_seqs = self.max_num_seqs or (256 if platform_device_type == "cpu" else 1024)
        max_batched = self.max_num_batched_tokens or default_tokens
        model_cfg = ModelConfig(
            model=files.display_name, weights_path=files.weights_path,
            tokenizer_path=files.tokenizer_path, architecture=architecture, hf_config=hf_config,
            dtype=dtype, max_model_len=max_model_len, eos_token_ids=files.eos_token_ids,
            served_model_name=self.served_model_name or files.display_name,
            chat_template=chat_template or files.chat_template, load_format=self.load_format,
            sampling_defaults=self._sampling_defaults(files.weights_path),
            skip_tokenizer_init=self.skip_tokenizer_init, gguf=files.gguf,
        )
        return EngineConfig(
            model=model_cfg,
            cache=CacheConfig(self.block_size, self.enable_prefix_caching,
                              self.kv_cache_memory_bytes, self.gpu_memory_utilization,
                              torch_dtype(self.linear_state_dtype), self.prefix_cache_retention_interval),
            scheduler=SchedulerConfig(max_num_seqs, max_batched, max_model_len,
                                      self.async_scheduling),
            parallel=ParallelConfig(self.tensor_parallel_size),
            device=self.device, attention_backend=self.attention_backend,
            moe_backend=self.moe_backend, seed=self.seed, max_logprobs=self.max_logprobs,
            enforce_eager=self.enforce_eager, cudagraph_mode=_cudagraph_mode(self.cudagraph_mode),
            speculative=speculative,
            draft_model=_draft_model_config(speculative, model_cfg, self.load_format),
            per_request_spec_decode_metrics=self.per_request_spec_decode_metrics,
        )

    def _check_types(self) -> None:
        """Each option has the type its annotation says, normalised in place: numpy numbers and
        ``os.PathLike`` paths are welcome, but a bool is not an int here, and the string "false"
        is not a bool (it would silently mean the opposite)."""
        for option in dataclasses.fields(self):
            value = getattr(self, option.name)
            annotation = str(option.type)  # "int | None": postponed annotations are strings
            kind, optional = annotation.split(" | ")[0], annotation.endswith("| None")
            if kind not in ("bool", "int", "float", "str") or (value is None and optional):
                continue
            normalised = _as_kind(kind, value, paths_allowed=option.name in _PATH_OPTIONS)
            if normalised is None:
                raise ValueError(f"{option.name} must be {'an' if kind == 'int' else 'a'} {kind}"
                                 f"{' or None' if optional else ''}, got {value!r}")
            setattr(self, option.name, normalised)

    def _validate(self) -> None:
        self._check_types()
        positive = ["max_num_seqs", "block_size", "tensor_parallel_size"]
        for name in positive + ["max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"]:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        interval = self.prefix_cache_retention_interval
        if interval < 0 or interval % self.block_size:
            raise ValueError(f"prefix_cache_retention_interval must be 0 or a positive multiple of block_size "
                             f"({self.block_size}), got {interval}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.linear_state_dtype not in _DTYPES:
            raise ValueError(f"linear_state_dtype must be one of {', '.join(_DTYPES)}, got {self.linear_state_dtype!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: tensor parallelism is not "
                             f"implemented yet; Weir runs a model on one device (tensor_parallel_size 1)")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(_LOAD_FORMATS)}, got {self.load_format!r}")
        if _cudagraph_mode(self.cudagraph_mode) not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)} (full_and_piecewise means "
                             f"full: Weir's graphs hold whole steps), got {self.cudagraph_mode!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.skip_tokenizer_init:
            for name in ("tokenizer", "chat_template"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs a tokenizer, but skip_tokenizer_init loads none: drop one of them")
        if self.per_request_spec_decode_metrics not in PER_REQUEST_METRICS_LEVELS:
            raise ValueError(f"per_request_spec_decode_metrics must be one of {', '.join(PER_REQUEST_METRICS_LEVELS)}, "
                             f"got {self.per_request_spec_decode_metrics!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config,
                                                                  (dict, str, SpeculativeConfig)):
            raise ValueError(f"speculative_config must be a dict or a JSON string, got "
                             f"{type(self.speculative_config).__name__}")
        if self.generation_config not in ("auto", "none", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be auto, none (or vllm) or a folder holding a "
                             f"generation_config.json, got {self.generation_config!r}")


_PATH_OPTIONS = frozenset({"model", "tokenizer", "chat_template", "generation_config"})


def _as_kind(kind: str, value: Any, paths_allowed: bool) -> Any:
    """``value`` as a plain bool / int / float / str, or None when it is not one."""
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):  # an int subclass, but never a count or a size
        return None
    if kind == "int":
        return operator.index(value) if isinstance(value, numbers.Integral) else None
    if kind == "float":
        return float(value) if isinstance(value, numbers.Real) else None
    if isinstance(value, str):
        return value
    return os.fspath(value) if paths_allowed and isinstance(value, os.PathLike) else None


def _draft_model_config(speculative: SpeculativeConfig | None, target: ModelConfig,
                        load_format: str) -> ModelConfig | None:
    """The draft checkpoint's config (draft_model, eagle, eagle3), run in the target's dtype and
    context; a draft whose vocabulary is not the target's is an error here, at start-up."""
    if speculative is None or speculative.model is None:
        return None
    from weir.model_files import resolve_model_files

    try:
        files = resolve_model_files(speculative.model, None)
    except (FileNotFoundError, ValueError) as error:  # the message names the path, not the field
        raise ValueError(f"speculative_config.model: {error}") from error
    _check_load_format(load_format, files.weights_path)
    vocab_size = getattr(files.hf_config, "vocab_size", None)
    if vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {speculative.model!r} has a vocabulary of {vocab_size} tokens, "
                         f"the target {target.model!r} one of {target.vocab_size}: a draft must share the target's "
                         f"vocabulary")
    draft_max = int(getattr(files.hf_config, "max_position_embeddings", 0) or 0) or target.max_model_len
    if speculative.method == "draft_model" and draft_max < target.max_model_len:
        raise ValueError(f"speculative_config.model {speculative.model!r} has max_position_embeddings={draft_max}, "
                         f"shorter than max_model_len={target.max_model_len}: the draft must cover the whole context "
                         f"(lower max_model_len)")
    return ModelConfig(
        model=files.display_name, weights_path=files.weights_path, tokenizer_path=files.tokenizer_path,
        architecture=files.architecture, hf_config=files.hf_config, dtype=target.dtype,
        max_model_len=target.max_model_len, eos_token_ids=target.eos_token_ids,
        served_model_name=files.display_name, load_format=load_format, skip_tokenizer_init=True, gguf=files.gguf)


def _check_load_format(load_format: str, weights_path: Path) -> None:
    is_gguf = weights_path.suffix == ".gguf"
    if (load_format == "safetensors" and is_gguf) or (load_format == "gguf" and not is_gguf):
        found = "a .gguf file" if is_gguf else "a checkpoint folder (safetensors)"
        raise ValueError(f"load_format={load_format!r}, but {weights_path} is {found}: pass load_format 'auto' "
                         f"(or the format it is)")


def _check_unquantized(hf_config, model_name: str, load_format: str) -> None:
    """Refuse quantized checkpoints (FP8, GPTQ, AWQ...): their weights would fail to load with
    errors about unexpected scale tensors, or load as plain values without their scales."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    if load_format == "dummy":  # random weights in the model dtype: the config's shapes are what counts
        logger.warning("%s is quantized (quant_method %r); load_format='dummy' gives it random unquantized "
                       "weights", model_name, method)
        return
    raise ValueError(f"{model_name} is a quantized checkpoint (quantization_config with quant_method {method!r}); "
                     f"Weir loads unquantized weights only (bfloat16, float16 or float32): use the "
                     f"checkpoint's unquantized release")


def _resolve_dtype(name: str, hf_config: Any, device_type: str) -> torch.dtype:
    import torch

    if name != "auto":
        return torch_dtype(name)
    if device_type == "cpu":
        # CPUs without bf16 units run half types far slower than fp32, and fp32 is the
        # reference precision; ask for bfloat16 explicitly to use it.
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = torch_dtype(config_dtype) if config_dtype in _DTYPES else None
    if config_dtype in (None, torch.float32):
        return torch.bfloat16
    return config_dtype
