"""Linear layers without initialisation cost, and fused (merged) projections.

Weights are ``torch.empty``: the loader overwrites every element, so random init would only waste
start-up time. A merged layer runs several projections of the same input as one GEMM, its weight
the checkpoint's separate weights concatenated along the output dim; the loader writes each
checkpoint tensor into its shard through ``shard_slice``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weir.kernels.dispatch import triton_module, use_triton

# Narrower projections have too few output tiles to fill the GPU from one row: cuBLAS keeps them.
MIN_GEMV_OUT_FEATURES = 1024


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``weight [out_features, in_features]`` as in ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.numel() == x.shape[-1] and self.bias is None and self.out_features >= MIN_GEMV_OUT_FEATURES
                and self.weight.stride(-1) == 1 and use_triton(x)):
            # One row (a batch-1 decode step): Weir's GEMV streams the weight in one launch, where
            # cuBLAS picks split-K kernels plus a reduce for several of these shapes.
            out = triton_module("triton_gemv").gemv(x.reshape(1, -1), self.weight)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)  # [..., out_features]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Fp32Linear(Linear):
    """``y = x @ W.T (+ b)`` in float32 with ``W`` (and ``b``) kept float32 (``keep_fp32_params``),
    as transformers computes DeepSeek's router logits and DSA's ``weights_proj``.

    After loading on CUDA the weight is also split into two bf16 halves, ``hi = bf16(W)`` and
    ``lo = bf16(W - hi)``. A bf16 ``x`` is exact in bf16, so one bf16 GEMM of ``x`` against
    ``[hi; lo]`` accumulating and writing float32, its two halves summed, is the float32 product
    to about 2**-16 relative: at tensor-core speed, and without a float32 copy of ``x`` (the exact
    float32 GEMM, on CUDA cores, took most of these layers' time in a long prefill). Other inputs
    (float32 reference runs, the CPU, ROCm, fp16 models) take the exact float32 GEMM. Both copies
    are kept, as the layer cannot tell which its inputs will be: the halves add the fp32 weight's
    size again (about 0.5 GiB over the full DeepSeek-V3.2's routers and indexers), which the
    memory profile sees as used memory, not as weights.
    """

    keep_fp32_params = ("weight", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.split_weight: torch.Tensor | None = None  # [2 * out_features, in_features] bf16: hi, then lo

    def process_weights_after_loading(self) -> None:
        # CUDA builds only: the 16-bit GEMM writing float32 (mm's out_dtype) is unchecked on ROCm.
        if self.weight.is_cuda and torch.version.hip is None:
            hi = self.weight.to(torch.bfloat16)
            self.split_weight = torch.cat([hi, (self.weight - hi.float()).to(torch.bfloat16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., out_features] fp32
        if self.split_weight is None or x.dtype != torch.bfloat16:
            return F.linear(x.float(), self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # [T, in_features]
        halves = torch.mm(rows, self.split_weight.t(), out_dtype=torch.float32)  # [T, 2 * out_features]
        out = halves[:, :self.out_features] + halves[:, self.out_features:]
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


class MergedLinear(Linear):
    """Several projections of one input fused into a single GEMM.

    ``shard_sizes`` names each projection's output size in output order, e.g.
    ``{"gate": 1024, "up": 1024}``. ``forward`` returns the concatenated output; ``split``
    cuts it back into the named parts.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)
        self._shard_offsets: dict[str, int] = {}
        offset = 0
        for shard_id, size in self.shard_sizes.items():
            self._shard_offsets[shard_id] = offset
            offset += size

    @property
    def shard_ids(self) -> tuple[str, ...]:
        return tuple(self.shard_sizes)

    def shard_slice(self, shard_id: str) -> slice:
        """Rows of ``weight`` (and entries of ``bias``) that hold projection ``shard_id``."""
        if shard_id not in self.shard_sizes:
            raise KeyError(f"unknown shard {shard_id!r}; this layer has {', '.join(self.shard_sizes)}")
        start = self._shard_offsets[shard_id]
        return slice(start, start + self.shard_sizes[shard_id])

    def split(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[..., out_features]`` -> one view per shard, in shard order."""
        return output.split(list(self.shard_sizes.values()), dim=-1)


class QKVLinear(MergedLinear):
    """q, k and v projections as one GEMM; shards ``"q"``, ``"k"``, ``"v"``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False):
        super().__init__(hidden_size, {
            "q": num_heads * head_dim,
            "k": num_kv_heads * head_dim,
            "v": num_kv_heads * head_dim,
        }, bias)


# Checkpoint names of the projections fused above, for a model's ``stacked_params``:
# (fused param name, checkpoint name, shard id), matched on whole dotted name components.
QKV_GATE_UP_STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
