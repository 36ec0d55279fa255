"""Multi-head latent attention (DeepSeek-V3's MLA) over a paged latent cache, and its sparse
variant (DeepSeek-V3.2's DSA: a lightning indexer picks the keys each query attends to).

The cache keeps, per token, one latent "head": the normalised ``kv_lora_rank`` latent ``c``, then
the ``qk_rope_head_dim`` rotated rope key ``k_pe`` shared by every head, and for sparse layers
the indexer's ``index_head_dim`` key after them:
``kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim (+ index_head_dim)]``.

Per head h, with ``W_UK_h [qk_nope, kv_lora_rank]`` and ``W_UV_h [v_head_dim, kv_lora_rank]`` (the
two row blocks of the layer's ``kv_b_proj`` weight):
``s_h(t, j) = scale * (q_nope_h(t) . W_UK_h c_j + q_pe_h(t) . k_pe_j)``, causal over the request's
tokens (and, for sparse layers, over the keys the indexer kept for query t),
``o_h(t) = W_UV_h sum_j softmax_j(s_h(t, j)) c_j``. A backend may compute this expanded (per-head
keys and values from the latent, usual for prefill) or absorbed (``W_UK_h^T q_nope_h`` first: MQA
over the 576-dim latent key, usual for decode); the two agree up to rounding.

The indexer (sparse layers): ``score(t, j) = sum_g w(t, g) * relu(q_idx_g(t) . k_idx_j)`` over
the ``index_n_heads`` heads g (``w`` fp32, every scale folded in by the model), causal; query t
attends to the ``index_topk`` keys of highest score among its causal prefix (all of them when the
prefix is shorter). Ties at the boundary may go either way. A sparse layer may also have no
indexer and attend to the keys the forward's last layer with one picked (GLM-5's "shared"
layers, ``MLALayerSpec.shares_topk``; ``SelectedKeys`` carries the pick between them).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from weir.attention import AttentionBackend, AttentionMetadata
from weir.layer_cache import PagedCacheSpec

MLA = "mla"
SPARSE_MLA = "sparse_mla"


@dataclass(frozen=True)
class MLALayerSpec(PagedCacheSpec):
    """What an MLA layer needs from its backend and from the paged latent cache."""

    layer_idx: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # the softmax scale, mscale folded in
    # Sparse layers (DSA): the indexer's heads, head size and how many keys each query keeps.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # A sparse layer with no indexer (nor indexer cache) of its own, which attends to the keys the
    # forward's last sparse layer with one picked (GLM-5's "shared" layers): index_topk only.
    shares_topk: bool = False

    def __post_init__(self):
        if self.shares_topk:
            if self.index_topk <= 0 or self.index_head_dim or self.index_n_heads:
                raise ValueError(f"layer {self.layer_idx}: a layer sharing another's top-k needs index_topk "
                                 f"positive and no indexer (index_head_dim and index_n_heads 0), got "
                                 f"{self.index_topk}, {self.index_head_dim}, {self.index_n_heads}")
        elif self.index_topk < 0 or (self.index_topk > 0) != (self.index_head_dim > 0 and self.index_n_heads > 0):
            raise ValueError(f"layer {self.layer_idx}: a sparse MLA layer needs index_topk, index_head_dim and "
                             f"index_n_heads all positive (a dense one all 0), got {self.index_topk}, "
                             f"{self.index_head_dim}, {self.index_n_heads}")

    @property
    def kind(self) -> str:
        return SPARSE_MLA if self.index_topk else MLA

    @property
    def latent_dim(self) -> int:
        """Cache columns of the latent and the rope key: the absorbed form's key size."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Cache columns per token: latent, rope key, then the indexer key of sparse layers (with
        an indexer of their own)."""
        return self.latent_dim + self.index_head_dim


@dataclass
class IndexerInputs:
    """One step's lightning-indexer inputs of a sparse MLA layer (token order of the step)."""

    q: torch.Tensor  # [num_tokens, index_n_heads, index_head_dim], rope applied
    k: torch.Tensor  # [num_tokens, index_head_dim], normalised, rope applied; stored in the cache
    weights: torch.Tensor  # [num_tokens, index_n_heads] fp32, every scale folded in


@dataclass
class SelectedKeys:
    """The keys the last sparse layer with an indexer picked in one forward, for the layers after
    it that share them (``MLALayerSpec.shares_topk``). A model makes one per forward and hands it
    to every sparse layer; ``keys`` is in the form of the backend serving them (one backend
    serves every layer of a kind), None until such a layer attended sparsely."""

    keys: object = None


def attended_keys(layer: MLALayerSpec, selected: SelectedKeys | None, pick: Callable[[], object]) -> object:
    """The keys a sparse step of ``layer`` attends to, in the backend's form: for a layer sharing a
    top-k those in ``selected``; otherwise ``pick()``'s, left in ``selected`` (when given) for the
    layers after it."""
    if layer.shares_topk:
        if selected.keys is None:
            raise RuntimeError(f"MLA layer {layer.layer_idx} shares the top-k of an earlier layer, but no "
                               f"sparse layer with an indexer ran before it in this forward")
        return selected.keys
    keys = pick()
    if selected is not None:
        selected.keys = keys
    return keys


class MLABackend(AttentionBackend):
    """The base of backends serving ``mla`` (and, with an indexer, ``sparse_mla``) layers.

    Registered and selected like any attention backend (``weir_attention_backends``, one backend
    per layer kind); constructed as ``cls(block_size, dtype, device)``. The model computes the
    projections, the latent norm and RoPE; the backend stores this step's latent, rope key (and
    indexer key) at ``slot_mapping`` and attends as the module docstring says.
    """

    supported_layer_kinds: ClassVar[frozenset[str]] = frozenset({MLA})

    def kv_cache_shape(self, num_blocks: int, layer: MLALayerSpec) -> tuple[int, ...]:
        return (num_blocks, self.block_size, layer.cache_dim)

    @abstractmethod
    def forward(
        self,
        layer: MLALayerSpec,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rope applied
        kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank], normalised
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rope applied
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: AttentionMetadata,
        w_uk: torch.Tensor,  # [num_heads, qk_nope_head_dim, kv_lora_rank]
        w_uv: torch.Tensor,  # [num_heads, v_head_dim, kv_lora_rank]
        indexer: IndexerInputs | None = None,  # sparse layers with an indexer of their own
        selected: SelectedKeys | None = None,  # sparse layers: this forward's shared pick
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        """Store this step's cache rows, then attend: sparse layers to the keys ``indexer`` picks
        (and leave them in ``selected``, when given), layers that share a top-k to the keys in
        ``selected``."""


def check_forward_inputs(layer: MLALayerSpec, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                         k_pe: torch.Tensor, kv_cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                         indexer: IndexerInputs | None, block_size: int | None = None,
                         selected: SelectedKeys | None = None) -> dict[str, torch.Tensor]:
    """Raise ``ValueError`` naming the first argument whose shape breaks the contract of
    ``MLABackend.forward`` (shapes only: nothing is read from the device); ``block_size``, when
    given, is the cache's too. Returns the inputs by name, for a backend's own checks (strides)."""
    if layer.shares_topk:
        if indexer is not None:
            raise ValueError(f"MLA layer {layer.layer_idx} shares another layer's top-k (it has no indexer) but "
                             f"forward got indexer inputs")
        if selected is None:
            raise ValueError(f"MLA layer {layer.layer_idx} shares another layer's top-k but forward got no "
                             f"SelectedKeys to read it from")
    elif layer.kind == SPARSE_MLA and indexer is None:
        raise ValueError(f"MLA layer {layer.layer_idx} is sparse (index_topk={layer.index_topk}) but forward "
                         f"got no indexer inputs")
    if layer.kind == MLA and indexer is not None:
        raise ValueError(f"MLA layer {layer.layer_idx} is dense (index_topk=0) but forward got indexer inputs")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != layer.cache_dim or block_size not in (None, kv_cache.shape[1]):
        raise ValueError(f"MLA layer {layer.layer_idx}: kv_cache must be [num_blocks, "
                         f"{'block_size' if block_size is None else block_size}, {layer.cache_dim}], "
                         f"got {list(kv_cache.shape)}")
    num_tokens, heads = q_nope.shape[0], layer.num_heads
    expected = {
        "q_nope": (q_nope, (num_tokens, heads, layer.qk_nope_head_dim)),
        "q_pe": (q_pe, (num_tokens, heads, layer.qk_rope_head_dim)),
        "kv_c": (kv_c, (num_tokens, layer.kv_lora_rank)),
        "k_pe": (k_pe, (num_tokens, layer.qk_rope_head_dim)),
        "w_uk": (w_uk, (heads, layer.qk_nope_head_dim, layer.kv_lora_rank)),
        "w_uv": (w_uv, (heads, layer.v_head_dim, layer.kv_lora_rank)),
    }
    if indexer is not None:
        expected.update({
            "indexer.q": (indexer.q, (num_tokens, layer.index_n_heads, layer.index_head_dim)),
            "indexer.k": (indexer.k, (num_tokens, layer.index_head_dim)),
            "indexer.weights": (indexer.weights, (num_tokens, layer.index_n_heads)),
        })
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"MLA layer {layer.layer_idx}: {name} must be {list(shape)}, got {list(tensor.shape)}")
    if indexer is not None and indexer.weights.dtype != torch.float32:
        raise ValueError(f"MLA layer {layer.layer_idx}: indexer.weights must be float32, got {indexer.weights.dtype}")
    return {"kv_cache": kv_cache, **{name: tensor for name, (tensor, _) in expected.items()}}
