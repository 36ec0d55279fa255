"""What every model class must provide: the contract between model plugins, loader and runner.

A model plugin registers ``ModelSpec(architecture, "pkg.module:XForCausalLM")``; the class::

    class XForCausalLM(nn.Module):
        stacked_params: ClassVar[Sequence[tuple[str, str, str]]]  # optional, default ()
        stacked_param_patterns: ClassVar[Sequence[tuple[str, str, str]]]  # optional, default ()
        ignored_checkpoint_patterns: ClassVar[Sequence[str]]  # optional, default ()

        def __init__(self, config: weir.config.ModelConfig): ...
        def forward(self, input_ids, positions, ctx) -> Tensor: ...
        def compute_logits(self, hidden_states) -> Tensor: ...
        def attention_layers(self) -> list[PagedCacheSpec]: ...  # AttentionLayerSpec, or another paged kind
        def state_layers(self) -> list[StateCacheSpec]: ...  # optional (hybrid models)

- ``__init__`` reads ``config.hf_config`` (the transformers ``PretrainedConfig``) and
  ``config.max_model_len``; it runs under ``torch.device("meta")`` and must not initialise
  weights (``weir.layers`` modules allocate ``torch.empty``). Parameter names mirror the HF
  module names (``model.layers.0.self_attn.o_proj.weight``) so checkpoint names map directly.
- ``stacked_params``: ``(fused_param, checkpoint_name, shard_id)`` entries such as
  ``("qkv_proj", "q_proj", "q")``: the checkpoint tensor ``...q_proj.weight`` is written into
  shard ``"q"`` of the ``MergedLinear`` at ``...qkv_proj`` (names match on whole dotted parts).
  A checkpoint that stores the fused tensor already (Phi-3's ``qkv_proj``, ``gate_up_proj``)
  needs no entry: a tensor named as the parameter loads whole, shape-checked.
- ``stacked_param_patterns``: ``(regex, parameter, shard id)`` rules for names a plain
  substitution cannot map, such as per-expert tensors stacked into one parameter
  (``weir.layers.moe.PER_EXPERT_PATTERNS``: ``...experts.7.up_proj.weight`` -> shard ``up.7`` of
  ``...experts.gate_up_proj``); the parameter and shard are ``match.expand`` templates. A module
  whose parameters have different shards lists them per parameter (``param_shard_ids(attr)``);
  one whose parameter holds more than a whole checkpoint tensor fills names that part
  (``whole_slice(attr)``: ``FusedExperts`` keeps its shared experts after the routed ones).
- ``ignored_checkpoint_patterns``: regexes (``re.search``) of checkpoint names to skip, such as
  ``rotary_emb\\.inv_freq``. A checkpoint copy of a tied weight (``lm_head.weight`` when tied) is
  skipped without being listed.
- ``forward(input_ids [T] int64, positions [T] int64, ctx: ForwardContext) -> [T, hidden]``:
  the tokens of all requests of the step, flattened; ``ctx.layers[layer_idx]`` is the
  ``LayerContext`` (backend, cache, metadata) of every layer that declared a cache spec
  (``weir.layer_cache``).
- ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` in the model dtype, for the N rows the
  sampler needs (usually each request's last token).
- ``attention_layers()``: one paged spec per layer with a per-token cache (``AttentionLayerSpec``
  for softmax attention, full or windowed), each with the ``layer_idx`` its ``weir.layers.Attention``
  module reads ``ctx.layers`` at; the runner groups them by window, sizes and allocates each
  group's cache (and refuses a model whose attention modules they miss).
  A model reads its layers' windows with ``weir.layers.attention.sliding_windows_of`` (the Llama
  skeleton every subclass shares does); one that implements full attention only calls
  ``weir.layers.attention.require_full_attention(hf_config, max_model_len)`` in ``__init__``: it
  refuses configs whose ``layer_types`` or ``sliding_window`` a full-attention model would
  silently ignore.
- ``state_layers()`` (hybrid models): one spec per linear-attention layer; each gets per-request
  state slots (``weir.linear_attention``): its ``LayerContext.cache`` is its ``LayerState``. MoE
  layers call ``ctx.moe_backend``
  (``weir.layers.moe.FusedExperts`` does, shared experts included when it holds them).
- Modules owning non-persistent buffers (cos/sin caches) define
  ``materialize_buffers(device)``; modules that rearrange checkpoint layouts once (fused
  projections regrouped for the forward) define ``process_weights_after_loading()``; the loader
  calls both after the weights are loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from weir.attention import AttentionLayerSpec
    from weir.config import ModelConfig
    from weir.layer_cache import ForwardContext


@runtime_checkable
class CausalLM(Protocol):
    """Static-typing view of the contract above (model classes need not inherit from it)."""

    stacked_params: ClassVar[Sequence[tuple[str, str, str]]]
    ignored_checkpoint_patterns: ClassVar[Sequence[str]]

    def __init__(self, config: ModelConfig) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def attention_layers(self) -> list[AttentionLayerSpec]: ...


# forward is left out: every nn.Module has one (that raises when called), so torch names it.
REQUIRED_METHODS = ("compute_logits", "attention_layers")


def check_model_class(model_cls: type) -> None:
    """Raise naming what a model class lacks of the contract above, before it is built."""
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(model_cls, name, None))]
    if missing:
        raise TypeError(f"model class {model_cls.__module__}.{model_cls.__qualname__} lacks "
                        f"{', '.join(f'{name}()' for name in missing)}, which every Weir model defines "
                        f"(weir.model_interface)")
