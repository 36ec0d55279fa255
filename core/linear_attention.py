"""The linear-attention (state-slot) backend interface: Gated DeltaNet, Kimi Delta Attention and kin.

A linear-attention layer keeps no per-token KV. Each running request owns one *state slot*
(handed out by the cache manager at admission, freed at finish, abort or preemption), and the
layer's state tensors are indexed by slot. Both built-in kinds keep the same two tensors, shaped
by the layer spec (``conv_dim``, ``conv_kernel``, ``recurrent_state_shape``):

- ``conv_state [num_slots + 1, conv_dim, conv_kernel]``: the last ``conv_kernel`` inputs of the
  causal depthwise conv (model dtype), oldest first, as transformers and fla keep them;
- ``recurrent_state [num_slots + 1, heads, key_dim, value_dim]``: ``o = q^T S``; fp32 by default
  (``linear_state_dtype``), always updated in fp32 and rounded only when stored.

Each state kind has its own spec and its own backend base with the forward contract of its
layers: ``GatedDeltaNetLayerSpec`` / ``LinearAttentionBackend`` (kind ``gated_delta_net``, a
scalar decay per head) and ``KimiDeltaAttentionLayerSpec`` / ``KimiDeltaAttentionBackend``
(kind ``kimi_delta_attention``, a decay per key channel). ``LinearAttentionBackend`` is also the
class every state-slot backend derives from (the runner and the plugin registry take any
subclass): a backend of another kind overrides ``supported_layer_kinds`` and ``forward``, and
``allocate_state`` / ``state_bytes_per_slot`` when its state is not these two tensors.

The extra last slot (index ``num_slots``) absorbs the writes of CUDA-graph padding requests.
A slot is zeroed by the runner when a request is admitted into it, so a backend always reads the
slot as the request's initial state (zeros before its first token) and writes the state after
the step back into it. Chunked prefill therefore carries state across chunks for free.

Prefix caching keeps *checkpoints* of these states (``weir.kv_cache.state_checkpoints``): a
second set of the layer's state tensors, made by the same ``allocate_state`` (so its layout is the
backend's own), into which the runner copies a request's slot after a step, and from which it
copies a checkpoint into an admitted request's slot instead of zeroing it. The copies go through
``copy_state_slots``: every tensor attribute of a state object is slot-indexed along dim 0 (as
``LayerState``'s are), or its class defines ``copy_slots(slots, target, target_slots)``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weir.layer_cache import LayerBackend, StateCacheSpec

GATED_DELTA_NET = "gated_delta_net"
KIMI_DELTA_ATTENTION = "kimi_delta_attention"


@dataclass(frozen=True)
class GatedDeltaNetLayerSpec(StateCacheSpec):
    """Shapes of one Gated DeltaNet layer (as Qwen3-Next's ``linear_*`` config fields give them).

    Value head ``h`` uses q/k head ``h // (num_v_heads // num_k_heads)``.
    """

    layer_idx: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    kind: str = GATED_DELTA_NET

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"layer {self.layer_idx}: {self.num_v_heads} value heads are not a multiple of "
                             f"{self.num_k_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k, then v, flattened."""
        return 2 * self.key_dim + self.value_dim

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """One slot's recurrent state: ``[value heads, head_k_dim, head_v_dim]``."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True)
class KimiDeltaAttentionLayerSpec(StateCacheSpec):
    """Shapes of one Kimi Delta Attention layer (``linear_attn_config``'s ``num_heads``,
    ``head_dim`` and ``short_conv_kernel_size``): q, k and v each have ``num_heads`` heads of
    ``head_dim``, so the state of a head is ``[head_dim, head_dim]``."""

    layer_idx: int
    num_heads: int
    head_dim: int
    conv_kernel: int
    kind: str = KIMI_DELTA_ATTENTION

    def __post_init__(self):
        if min(self.num_heads, self.head_dim, self.conv_kernel) < 1:
            raise ValueError(f"layer {self.layer_idx}: a Kimi Delta Attention layer needs positive num_heads, "
                             f"head_dim and conv_kernel, got {self.num_heads}, {self.head_dim}, {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        """Channels of each of q, k and v (also the per-channel decay's)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convs: q, k, then v, flattened (three depthwise convs side by side)."""
        return 3 * self.key_dim

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """One slot's recurrent state: ``[heads, head_dim, head_dim]``."""
        return (self.num_heads, self.head_dim, self.head_dim)


@dataclass
class LinearAttentionMetadata:
    """Step inputs shared by every linear-attention layer of one forward (batch order)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    state_indices: torch.Tensor  # [num_reqs] int32, device: each request's state slot
    num_reqs: int
    num_tokens: int
    max_query_len: int  # host-known; 1 means every request decodes one token
    # [num_reqs + 1] int32 on the CPU when the host knows it (eager steps): lets varlen kernels
    # prepare their chunk indices without reading the device. None inside CUDA graphs.
    query_start_loc_cpu: torch.Tensor | None = None


@dataclass
class LayerState:
    """One linear-attention layer's state tensors, indexed by slot."""

    conv_state: torch.Tensor  # [num_slots + 1, conv_dim, conv_kernel], model dtype
    recurrent_state: torch.Tensor  # [num_slots + 1, *recurrent_state_shape], state_dtype

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Reset the given slots (int64 device indices) for newly admitted requests."""
        self.conv_state.index_fill_(0, slots, 0)
        self.recurrent_state.index_fill_(0, slots, 0)


def copy_state_slots(source: Any, slots: torch.Tensor, target: Any, target_slots: torch.Tensor) -> None:
    """``target[target_slots] = source[slots]`` for one layer's state objects (int64 device
    indices of equal length, distinct targets), on the device with no host sync: the class's own
    ``copy_slots`` if it has one, else every tensor attribute along dim 0."""
    if hasattr(source, "copy_slots"):
        source.copy_slots(slots, target, target_slots)
        return
    tensors = {name: value for name, value in vars(source).items() if isinstance(value, torch.Tensor)}
    if not tensors:
        raise TypeError(f"{type(source).__name__} holds no tensors to copy between state slots; give it a "
                        f"copy_slots(slots, target, target_slots) method (weir.linear_attention)")
    for name, tensor in tensors.items():
        getattr(target, name).index_copy_(0, target_slots, tensor.index_select(0, slots))


class LinearAttentionBackend(LayerBackend, ABC):
    """A way to run Gated DeltaNet layers over per-request state slots (and the base of every
    state-slot backend: see the module docstring).

    The model computes the projections and the gates; the backend, per request and token:

    1. shifts the token's pre-conv channels into the slot's conv window and takes
       ``SiLU(sum_j window[:, j] * conv_weight[:, j])`` in fp32, rounded to the model dtype;
    2. splits the result into q ``[H, Dk]``, k ``[H, Dk]``, v ``[HV, Dv]`` (value head ``h`` uses
       q/k head ``h // (HV // H)``) and, in fp32, L2-normalises q and k as
       ``x * rsqrt(sum(x^2) + 1e-6)``, then scales q by ``Dk ** -0.5``;
    3. runs the gated delta rule in fp32 on the slot's state ``S [HV, Dk, Dv]``:
       ``S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q``, with ``beta`` read as fp32;
    4. returns ``o`` in the model dtype and leaves the conv window and ``S`` in the slot.

    ``weir.plugins.attention.gdn_torch`` is the reference. Registered through the
    ``weir_attention_backends`` hook (its ``supported_layer_kinds`` say ``gated_delta_net``) and
    constructed as ``cls(dtype, device, state_dtype)``.
    """

    supported_layer_kinds: ClassVar[frozenset[str]] = frozenset({GATED_DELTA_NET})

    def __init__(self, dtype: torch.dtype, device: torch.device, state_dtype: torch.dtype = torch.float32):
        """``dtype``: the model's (inputs, outputs, conv state); ``state_dtype``: the recurrent state's."""
        self.dtype = dtype
        self.device = device
        self.state_dtype = state_dtype

    def allocate_state(self, num_slots: int, layer: StateCacheSpec) -> LayerState:
        """Zeroed state for ``num_slots`` requests plus the padding slot, shaped by the spec's
        ``conv_dim``, ``conv_kernel`` and ``recurrent_state_shape``."""
        return LayerState(
            conv_state=torch.zeros(num_slots + 1, layer.conv_dim, layer.conv_kernel,
                                   dtype=self.dtype, device=self.device),
            recurrent_state=torch.zeros(num_slots + 1, *layer.recurrent_state_shape,
                                        dtype=self.state_dtype, device=self.device),
        )

    def state_bytes_per_slot(self, layer: StateCacheSpec) -> int:
        conv = layer.conv_dim * layer.conv_kernel * self.dtype.itemsize
        recurrent = math.prod(layer.recurrent_state_shape) * self.state_dtype.itemsize
        return conv + recurrent

    def build_metadata(self, metadata: LinearAttentionMetadata) -> LinearAttentionMetadata:
        """Once per step: derive whatever the backend needs beyond the common metadata."""
        return metadata

    @abstractmethod
    def forward(
        self,
        layer: GatedDeltaNetLayerSpec,
        mixed_qkv: torch.Tensor,  # [num_tokens, conv_dim] pre-conv q|k|v channels; rows may be strided
        g: torch.Tensor,  # [num_tokens, num_v_heads] fp32 log-decay (<= 0)
        beta: torch.Tensor,  # [num_tokens, num_v_heads] in (0, 1)
        conv_weight: torch.Tensor,  # [conv_dim, conv_kernel]
        state: LayerState,
        metadata: LinearAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_v_heads, head_v_dim] in the model dtype
        """Conv + SiLU, split, L2-norm, gated delta rule; updates the request slots in place."""


class KimiDeltaAttentionBackend(LinearAttentionBackend):
    """A way to run Kimi Delta Attention layers (Kimi Linear's KDA) over per-request state slots.

    The state is ``LinearAttentionBackend``'s (``conv_state`` of the three depthwise convs side by
    side, ``recurrent_state [H, K, K]``). The model computes the projections and the gates; the
    backend, per request and token:

    1. shifts the token's pre-conv channels (q, k, v, each ``H * K``) into the slot's conv window
       and takes ``SiLU(sum_j window[:, j] * conv_weight[:, j])`` in fp32, rounded to the model dtype;
    2. splits the result into q, k, v ``[H, K]`` and, in fp32, L2-normalises q and k as
       ``x / sqrt(sum(x^2) + 1e-6)`` (transformers' and fla's Kimi formula), then scales q by
       ``K ** -0.5``;
    3. runs the delta rule with a decay per key channel in fp32 on the slot's state ``S [H, K, K]``:
       ``S = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q``, with ``g [H, K]`` and
       ``beta [H]`` read as fp32;
    4. returns ``o`` in the model dtype and leaves the conv window and ``S`` in the slot.

    ``weir.plugins.attention.kda_torch`` is the reference. Registered like any linear-attention
    backend (``supported_layer_kinds`` say ``kimi_delta_attention``) and constructed as
    ``cls(dtype, device, state_dtype)``.
    """

    supported_layer_kinds: ClassVar[frozenset[str]] = frozenset({KIMI_DELTA_ATTENTION})

    @abstractmethod
    def forward(
        self,
        layer: KimiDeltaAttentionLayerSpec,
        mixed_qkv: torch.Tensor,  # [num_tokens, 3 * H * K] pre-conv q|k|v channels; rows may be strided
        g: torch.Tensor,  # [num_tokens, H, K] fp32 log-decay per key channel (<= 0)
        beta: torch.Tensor,  # [num_tokens, H] in (0, 1)
        conv_weight: torch.Tensor,  # [3 * H * K, conv_kernel]
        state: LayerState,
        metadata: LinearAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, H, K] in the model dtype
        """Conv + SiLU, split, L2-norm, per-channel delta rule; updates the request slots in place."""
