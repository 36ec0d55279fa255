"""Building blocks shared by model plugins (norms, RoPE, fused linears, MLP, attention).

Every block allocates its weights with ``torch.empty`` and is meant to be built under
``torch.device("meta")``; ``weir.weights.loader.load_model`` materialises and fills it. The model
contract the runner and loader rely on is documented in ``weir.model_interface``.
"""

from weir.layers.attention import Attention, RopeSelfAttention, head_dim_of, num_kv_heads_of
from weir.layers.embedding import LMHead, VocabEmbedding
from weir.layers.linear import (QKV_GATE_UP_STACKED_PARAMS, Fp32Linear, Linear, MergedLinear,
                               QKVLinear)
from weir.layers.mlp import GatedMLP
from weir.layers.norm import RMSNorm
from weir.layers.rotary import RotaryEmbedding, rope_parameters_of

__all__ = [
    "Attention", "Fp32Linear", "GatedMLP", "LMHead", "Linear", "MergedLinear", "QKVLinear",
    "QKV_GATE_UP_STACKED_PARAMS",
    "RMSNorm", "RopeSelfAttention", "RotaryEmbedding", "VocabEmbedding", "head_dim_of",
    "num_kv_heads_of", "rope_parameters_of",
]
