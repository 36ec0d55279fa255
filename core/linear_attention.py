"""The linear-attention (state-slot) backend interface, for Gated DeltaNet layers and kin.

A linear-attention layer keeps no per-token KV. Each running request owns one *state slot*
(handed out by the cache manager at admission, freed at finish, abort or preemption), and the
layer's state tensors are indexed by slot:

- ``conv_state [num_slots + 1, conv_dim, conv_kernel]``: the last ``conv_kernel`` inputs of the
  causal depthwise conv (model dtype), oldest first, as transformers and fla keep them;
- ``recurrent_state [num_slots + 1, num_v_heads, head_k_dim, head_v_dim]``: ``o = q^T S``; fp32 by
  default (``linear_state_dtype``), always updated in fp32 and rounded only when stored.

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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weir.layer_cache import LayerBackend, StateCacheSpec

GATED_DELTA_NET = "gated_delta_net"


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
    recurrent_state: torch.Tensor  # [num_slots + 1, num_v_heads, head_k_dim, head_v_dim], state_dtype

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
    """A way to run Gated DeltaNet layers over per-request state slots.

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

    def allocate_state(self, num_slots: int, layer: GatedDeltaNetLayerSpec) -> LayerState:
        """Zeroed state for ``num_slots`` requests plus the padding slot."""
        return LayerState(
            conv_state=torch.zeros(num_slots + 1, layer.conv_dim, layer.conv_kernel,
                                   dtype=self.dtype, device=self.device),
            recurrent_state=torch.zeros(num_slots + 1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                                        dtype=self.state_dtype, device=self.device),
        )

    def state_bytes_per_slot(self, layer: GatedDeltaNetLayerSpec) -> int:
        conv = layer.conv_dim * layer.conv_kernel * self.dtype.itemsize
        recurrent = layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * self.state_dtype.itemsize
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
