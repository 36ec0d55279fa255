"""What a layer keeps per request, the backends that keep it, and what a forward hands each layer.

The two shapes of layer cache Weir's KV manager serves:

- ``PagedCacheSpec``: one entry per token, stored in fixed-size blocks of a paged pool (softmax
  attention's K/V, an MLA latent, an indexer's keys). Layers with the same ``sliding_window``
  share one block table per request: a *cache group*. A windowed group frees each block once it
  falls wholly before its request's window, so a request holds at most the window's blocks there.
- ``StateCacheSpec``: a fixed-size state per request (linear attention: conv + recurrent state),
  kept in a *state slot* the request holds while it runs; every such layer shares the one slot.

A model declares its layers' specs (``attention_layers()`` for paged ones, ``state_layers()`` for
state ones, ``weir.model_interface``). Each spec's ``kind`` picks the backend that serves the layer
and allocates its cache. A new kind of layer is a spec subclass plus a backend serving its kind:
the runner, the KV manager and the request table take it as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class PagedCacheSpec:
    """Base of the specs of layers with a per-token paged cache.

    Subclasses are frozen dataclasses with ``layer_idx: int`` and a ``kind`` (field or property);
    ``sliding_window`` (tokens a query sees, itself included; None: every token) decides the
    layer's cache group. The backend serving the kind gives the cache's shape per block.
    """

    layer_idx: int
    kind: str
    sliding_window: int | None = None


class StateCacheSpec:
    """Base of the specs of layers with a fixed-size state per request (one state slot each).

    Subclasses are frozen dataclasses with ``layer_idx: int`` and a ``kind``; the backend serving
    the kind allocates the slot-indexed state and says how many bytes a slot takes.
    """

    layer_idx: int
    kind: str


class LayerBackend:
    """What every layer backend (paged attention, linear attention, kinds to come) declares.

    Each layer kind of a model gets one backend (``weir.selection``): the one the user names, else
    the first of the platform's preferred backends that serves it. Registered through the
    ``weir_attention_backends`` hook.
    """

    name: ClassVar[str]
    supported_devices: ClassVar[frozenset[str]]
    supported_layer_kinds: ClassVar[frozenset[str]] = frozenset()
    # Decode (max_query_len == 1) reads per-request values from device tensors only and launches
    # grids fixed by host sizes that stay the same for a padded batch size: safe to capture in a
    # CUDA graph. ``build_metadata`` then runs inside the graph too, so its device work is replayed.
    supports_cuda_graphs: ClassVar[bool] = False
    # Mixed batches (prefills beside decodes) too, padded to a fixed ``num_tokens`` and
    # ``num_reqs``: every launch is sized by those two and ``max_query_len`` alone, padding
    # requests own no token (and read only the null block), and tokens past the last request
    # (slot -1, ``AttentionMetadata.has_unowned_tokens``) read no key and get zero output rows.
    # Full CUDA graphs then hold whole prefill steps, not only decode ones (``weir.runner.cuda_graphs``).
    supports_mixed_cuda_graphs: ClassVar[bool] = False

    @classmethod
    def supports(cls, device_type: str, layer_kinds: set[str]) -> bool:
        """Whether the backend runs on this device type and serves every one of these layer kinds."""
        return device_type in cls.supported_devices and layer_kinds <= cls.supported_layer_kinds

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend cannot run in this environment (a missing package), or None."""
        return None


@dataclass(frozen=True)
class LayerContext:
    """What one cache-holding layer uses in one forward."""

    backend: Any  # the LayerBackend serving the layer's kind
    cache: Any  # paged layers: the KV tensor the backend allocated; state layers: their LayerState
    metadata: Any  # what the backend's build_metadata made of this step's inputs for the layer's group


@dataclass
class ForwardContext:
    """Everything a model's layers need for one forward, passed explicitly (no globals).

    ``layers[layer_idx]`` is the ``LayerContext`` of every layer that declared a cache spec (None
    for the others); MoE layers hand their experts to ``moe_backend``.
    """

    layers: list[LayerContext | None]
    moe_backend: Any = None  # weir.moe.MoEBackend, for models with MoE layers
