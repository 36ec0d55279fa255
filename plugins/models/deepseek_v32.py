"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-MoE-DSA (``GlmMoeDsaForCausalLM``, GLM-5):
DeepSeek-V3 with sparse attention (DSA) on every layer. A lightning indexer scores the causal
keys of each query; the MLA backend keeps the ``index_topk`` best and attends to those only.

The indexer (transformers' ``DeepseekV32Indexer``): ``q = wq_b(q latent)`` per indexer head and one
key ``k = LayerNorm(wk(x))`` per token (stored in the latent cache after ``[kv_c | k_pe]``), both
``[rope | nope]`` with RoPE on the first ``qk_rope_head_dim`` dims (rotate_half for V3.2,
interleaved pairs for GLM-5) from the same cos/sin as MLA; head weights
``weights_proj(x)`` (float32, in and out) times ``index_n_heads ** -0.5``; the score
``sum_g w_g relu(q_g . k * index_head_dim ** -0.5)``. relu commutes with the positive scale, so
``index_head_dim ** -0.5`` is folded into the weights (``weir.mla.IndexerInputs``).

GLM-5's "shared" indexer layers have no indexer: they attend to the keys the last layer before
them with one picked (``weir.mla.SelectedKeys``, one per forward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weir.config import ModelConfig
from weir.layers import Fp32Linear, Linear, RotaryEmbedding
from weir.mla import IndexerInputs
from weir.plugins.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MTP, mla_rotary

INDEXER_NORM_EPS = 1e-6  # transformers' indexer k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` with weight and bias, allocated empty."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class LightningIndexer(nn.Module):
    """``self_attn.indexer``: the per-token indexer query heads, key and head weights."""

    def __init__(self, hf_config: Any, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.num_heads = hf_config.index_n_heads
        self.head_dim = hf_config.index_head_dim
        self.index_topk = hf_config.index_topk
        self.rope_dim = hf_config.qk_rope_head_dim
        if not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"the indexer ropes the first qk_rope_head_dim={self.rope_dim} dims of its "
                             f"index_head_dim={self.head_dim}: it needs 0 < qk_rope_head_dim <= index_head_dim")
        self.wq_b = Linear(hf_config.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = Linear(hf_config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, INDEXER_NORM_EPS)
        self.weights_proj = Fp32Linear(hf_config.hidden_size, self.num_heads)
        self.weights_scale = self.num_heads ** -0.5 * self.head_dim ** -0.5
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, q_latent: torch.Tensor) -> IndexerInputs:
        num_tokens = hidden_states.shape[0]
        q = self.wq_b(q_latent).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(1)  # [num_tokens, 1, head_dim]
        self.rotary_emb.rotate_in_place(positions, q[..., : self.rope_dim], k[..., : self.rope_dim])
        weights = self.weights_proj(hidden_states) * self.weights_scale  # [num_tokens, heads] fp32
        return IndexerInputs(q=q, k=k.squeeze(1), weights=weights)  # q [T, heads, head_dim], k [T, head_dim]


class DeepseekV32MTP(DeepseekV3MTP):
    """DeepSeek-V3.2's next-token module as a draft head (``speculative_config`` method ``mtp``):
    DeepSeek-V3's, its attention sparse like the target's, with a lightning indexer of its own
    (checkpoint ``model.layers.{num_hidden_layers}.self_attn.indexer.*``) whose keys sit in the
    head's latent cache rows."""

    indexer_rope_interleaved = False

    def make_indexer(self, hf_config: Any, layer_idx: int, max_positions: int) -> LightningIndexer:
        return LightningIndexer(hf_config, mla_rotary(hf_config, max_positions, self.indexer_rope_interleaved))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: every MLA layer sparse, its indexer's RoPE rotate_half (non-interleaved);
    its MTP module loads as ``DeepseekV32MTP``."""

    indexer_rope_interleaved = False
    mtp_head_class = DeepseekV32MTP

    def __init__(self, config: ModelConfig):
        hf_config = config.hf_config
        if not getattr(hf_config, "q_lora_rank", None):
            raise ValueError(f"{type(self).__name__} needs q_lora_rank: the indexer reads the q latent")
        topk = hf_config.index_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"index_topk must be a positive integer, got {topk!r}")
        self._indexer_rotary: RotaryEmbedding | None = None
        super().__init__(config)

    def make_indexer(self, hf_config: Any, layer_idx: int, max_positions: int) -> LightningIndexer:
        if self._indexer_rotary is None:  # one cos/sin cache for every layer's indexer
            self._indexer_rotary = mla_rotary(hf_config, max_positions, self.indexer_rope_interleaved)
        return LightningIndexer(hf_config, self._indexer_rotary)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: DeepSeek-V3.2's layers with interleaved indexer RoPE, where the layers that
    ``indexer_types`` names "shared" have no indexer (nor indexer cache) and attend to the keys
    the last "full" layer before them picked, as transformers' ``prev_topk_indices``. Its MTP
    module has no draft head yet (none has been checked against a reference)."""

    indexer_rope_interleaved = True
    mtp_head_class = None

    def __init__(self, config: ModelConfig):
        # Read before the layers are built: shares_topk answers from it.
        self.layer_indexer_types = self.checked_indexer_types(config.hf_config)
        super().__init__(config)

    @classmethod
    def checked_indexer_types(cls, hf_config: Any) -> list[str]:
        """Each layer's indexer kind, "full" or "shared": ``indexer_types``, which transformers'
        config derives from ``index_topk_freq`` and ``index_topk_pattern`` when the checkpoint
        lists none; every layer "full" when the config has none of the three."""
        kinds = getattr(hf_config, "indexer_types", None)
        if not kinds:
            derived_from = [name for name in ("index_topk_freq", "index_topk_pattern")
                            if getattr(hf_config, name, None) not in (None, 1, "")]
            if derived_from:  # a transformers too old to derive the list: its layers are unknown here
                raise ValueError(f"the config sets {', '.join(derived_from)} but no indexer_types, which "
                                 f"this transformers does not derive from them; list indexer_types in the "
                                 f"checkpoint's config.json or upgrade transformers")
            return ["full"] * hf_config.num_hidden_layers
        kinds = list(kinds)
        if any(kind not in ("full", "shared") for kind in kinds) or len(kinds) != hf_config.num_hidden_layers:
            raise ValueError(f"{cls.__name__}: indexer_types must name 'full' or 'shared' for each of the "
                             f"{hf_config.num_hidden_layers} layers, got {kinds}")
        if kinds[0] == "shared":
            raise ValueError(f"{cls.__name__}: layer 0 is 'shared' in indexer_types, but a shared layer "
                             f"reuses the top-k of a 'full' layer before it")
        return kinds

    def shares_topk(self, hf_config: Any, layer_idx: int) -> bool:
        return self.layer_indexer_types[layer_idx] == "shared"
