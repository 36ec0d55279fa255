"""The model's cache-holding layers as the runner holds them: cache groups, backends, caches,
and the forward context of each step.

Every layer the model declares (``attention_layers()``, ``state_layers()``) has a spec
(``weir.layer_cache``). Paged specs with the same ``sliding_window`` form one cache group, with
one block table per request; the full-attention group, if any, comes first. State specs share the
request's state slot. Each layer kind gets one backend instance, which allocates the layer's cache
and builds, once per step and group, the metadata its layers receive.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from weir.attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from weir.layer_cache import ForwardContext, LayerContext, PagedCacheSpec, StateCacheSpec
from weir.linear_attention import LinearAttentionBackend, LinearAttentionMetadata

logger = logging.getLogger(__name__)
GiB = 2**30


@dataclass(frozen=True)
class PagedGroup:
    """Paged layers that share one block table per request."""

    sliding_window: int | None
    layers: tuple[PagedCacheSpec, ...]

    def describe(self) -> str:
        kind = "full" if self.sliding_window is None else f"sliding window {self.sliding_window}"
        return f"{kind}, {len(self.layers)} layer{'s' * (len(self.layers) != 1)}"


class LayerCaches:
    def __init__(self, model: torch.nn.Module, choose_backends: Callable[[set[str]], dict[str, type]],
                 block_size: int, dtype: torch.dtype, device: torch.device, state_dtype: torch.dtype):
        """``choose_backends(layer_kinds) -> {kind: backend class}`` (``weir.selection``)."""
        model_name = type(model).__name__
        paged = list(model.attention_layers())
        state = list(getattr(model, "state_layers", list)())
        for spec in paged:
            if not isinstance(spec, PagedCacheSpec):
                raise TypeError(f"{model_name}.attention_layers() returned {type(spec).__name__}, which is not a "
                                f"weir.layer_cache.PagedCacheSpec")
        for spec in state:
            if not isinstance(spec, StateCacheSpec):
                raise TypeError(f"{model_name}.state_layers() returned {type(spec).__name__}, which is not a "
                                f"weir.layer_cache.StateCacheSpec")
        if not paged:
            raise ValueError(f"{model_name} declares no paged-cache layers; Weir's runner needs at least one")
        layer_ids = [spec.layer_idx for spec in paged + state]
        repeated = sorted({idx for idx in layer_ids if layer_ids.count(idx) > 1})
        if repeated:
            raise ValueError(f"{model_name} declares more than one cache for layers {repeated}")
        windows = sorted({spec.sliding_window for spec in paged}, key=lambda w: (w is not None, w or 0))
        self.groups = [PagedGroup(w, tuple(s for s in paged if s.sliding_window == w)) for w in windows]
        self.group_of_layer = {spec.layer_idx: g for g, group in enumerate(self.groups) for spec in group.layers}
        self.paged_layers = paged
        self.state_layers = state

        paged_kinds, state_kinds = {s.kind for s in paged}, {s.kind for s in state}
        if paged_kinds & state_kinds:
            raise ValueError(f"layer kinds {sorted(paged_kinds & state_kinds)} are declared both paged and state")
        backend_classes = choose_backends(paged_kinds | state_kinds)
        self.backends: dict[str, Any] = {}
        for kind in sorted(paged_kinds):
            self.backends[kind] = _construct(backend_classes[kind], AttentionBackend, kind, block_size, dtype, device)
        for kind in sorted(state_kinds):
            self.backends[kind] = _construct(backend_classes[kind], LinearAttentionBackend, kind, dtype, device,
                                             state_dtype)
        for spec in paged:
            backend = self.backends[spec.kind]
            if isinstance(spec, AttentionLayerSpec) and spec.has_sinks and not backend.supports_sinks:
                raise ValueError(f"layer {spec.layer_idx} has attention sinks, which attention backend "
                                 f"{backend.name!r} does not support; choose another (--attention-backend)")
        self.num_layers = max(layer_ids) + 1
        self.kv_caches: list[torch.Tensor | None] = [None] * self.num_layers
        self.layer_states: list[Any] = [None] * self.num_layers

    @property
    def supports_cuda_graphs(self) -> bool:
        return all(backend.supports_cuda_graphs for backend in self.backends.values())

    @property
    def supports_mixed_cuda_graphs(self) -> bool:
        """Whether whole mixed steps may be captured: every backend says so, and no layer keeps a
        per-request state (whose prefill kernels read host offsets)."""
        return not self.state_layers and all(backend.supports_mixed_cuda_graphs
                                             for backend in self.backends.values())

    def backend_of(self, spec) -> Any:
        return self.backends[spec.kind]

    def describe_backends(self) -> str:
        return ", ".join(f"{kind}={backend.name}" for kind, backend in self.backends.items())

    # ---- paged caches ------------------------------------------------------------------

    def bytes_per_block(self, group: PagedGroup) -> int:
        """Cache bytes one block of ``group`` takes across its layers."""
        return sum(self.backend_of(spec).kv_cache_bytes_per_block(spec) for spec in group.layers)

    def allocate_kv_caches(self, num_blocks: list[int]) -> None:
        """Each paged layer's cache, ``num_blocks[g]`` blocks for the layers of group ``g``; the
        caches held before are dropped first, so their memory can be reused."""
        for spec in self.paged_layers:
            self.kv_caches[spec.layer_idx] = None
        for g, group in enumerate(self.groups):
            for spec in group.layers:
                self.kv_caches[spec.layer_idx] = self.backend_of(spec).allocate_kv_cache(num_blocks[g], spec)

    # ---- one forward ---------------------------------------------------------------------

    def forward_context(self, paged_metadata: list[AttentionMetadata],
                        linear_metadata: LinearAttentionMetadata | None, moe_backend: Any) -> ForwardContext:
        """The context of one forward: ``paged_metadata[g]`` is group g's common metadata; each
        backend derives its own once per group (``build_metadata``)."""
        built: dict[tuple[str, int], Any] = {}
        layers: list[LayerContext | None] = [None] * self.num_layers
        for spec in self.paged_layers:
            key = (spec.kind, self.group_of_layer[spec.layer_idx])
            if key not in built:
                built[key] = self.backends[spec.kind].build_metadata(paged_metadata[key[1]])
            layers[spec.layer_idx] = LayerContext(self.backends[spec.kind], self.kv_caches[spec.layer_idx], built[key])
        for spec in self.state_layers:
            key = (spec.kind, -1)
            if key not in built:
                built[key] = self.backends[spec.kind].build_metadata(linear_metadata)
            layers[spec.layer_idx] = LayerContext(self.backends[spec.kind], self.layer_states[spec.layer_idx],
                                                  built[key])
        return ForwardContext(layers, moe_backend)


def _construct(backend_cls: type, base: type, kind: str, *args) -> Any:
    if not issubclass(backend_cls, base):
        raise TypeError(f"backend {getattr(backend_cls, 'name', backend_cls.__name__)!r} serves layer kind {kind!r} "
                        f"but is not a {base.__module__}.{base.__name__}, which that kind's layers need")
    return backend_cls(*args)
