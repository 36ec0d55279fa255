"""Rotary position embedding (rotate_half / NeoX layout) with transformers' frequency scaling.

The inverse frequencies come from transformers itself (``ROPE_INIT_FUNCTIONS``) for every scaled
RoPE type but "longrope" (refused: transformers switches between its short and long factors by
sequence length, which one cache cannot hold), so a scaling variant can never drift from the
reference. ``cos`` and ``sin`` for every
position up to ``max_positions`` are computed once into a cache; a forward is a gather plus the
rotation.

"dynamic" (NTK) RoPE: transformers recomputes the frequencies per batch from the longest
sequence; Weir computes them once for ``max_positions`` (= max_model_len), as vLLM does. Both give
the unscaled frequencies whenever the sequence (resp. max_model_len) is within the model's
``max_position_embeddings`` (the original length that dynamic scaling stretches from), and Weir
caps max_model_len there, so the two agree on every sequence Weir accepts.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from weir.kernels.dispatch import triton_module, use_triton
from weir.layers.norm import RMSNorm, ZeroCenteredRMSNorm

# Types whose frequencies depend on the live sequence length in a way one cache cannot hold.
_UNSUPPORTED_ROPE_TYPES = {"longrope"}


def rope_parameters_of(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as transformers 5.x standardises them.

    Reads ``rope_parameters`` (5.x) or the legacy ``rope_scaling`` + ``rope_theta`` fields, and
    always returns ``rope_type`` and ``rope_theta`` (plus ``partial_rotary_factor`` when set).
    """
    raw = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(raw)
    nested = [key for key, value in params.items() if isinstance(value, dict)]
    if nested:
        raise ValueError(f"rope_parameters per layer type ({', '.join(nested)}) are not supported yet")
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(getattr(hf_config, "rope_theta", None) or 10000.0)
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings",
                          original or hf_config.max_position_embeddings)
    return params


def compute_inv_freq(
    hf_config: Any, head_dim: int, rotary_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2] fp32 on the CPU, attention_scaling)`` for this config."""
    params = rope_parameters_of(hf_config)
    rope_type = params["rope_type"]
    theta = params.get("rope_theta")
    if rope_type == "default" and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0):
        raise ValueError(f"rope_theta in the config must be a positive number, got {theta!r}")
    if rope_type in _UNSUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported by Weir's rotary embedding")
    with torch.device("cpu"):  # models are built under the meta device; these few floats are real
        if rope_type == "default":
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
            inv_freq, attention_scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unknown rope_type {rope_type!r}; transformers knows "
                                 f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
            # transformers' init functions standardise (write to) the config: give them a copy.
            config_copy = copy.deepcopy(hf_config)
            config_copy.rope_parameters = params
            config_copy.head_dim = head_dim
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](
                config_copy, torch.device("cpu"), seq_len=max_positions)
    inv_freq = inv_freq.float()
    if inv_freq.numel() * 2 != rotary_dim:
        raise ValueError(f"rope_type={rope_type!r} produced {inv_freq.numel()} frequencies, "
                         f"but rotary_dim={rotary_dim} needs {rotary_dim // 2}")
    return inv_freq, float(attention_scaling)


def rotary_dim_of(hf_config: Any, head_dim: int) -> int:
    """Rotated dims per head: ``head_dim * partial_rotary_factor`` (all of them by default)."""
    factor = rope_parameters_of(hf_config).get("partial_rotary_factor") or 1.0
    return int(head_dim * factor)


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of each q/k head (the rest pass through).

    Layout is rotate_half: dim ``i`` pairs with dim ``i + rotary_dim // 2``. The cos/sin cache
    is a non-persistent buffer: the model is built on the meta device, so the loader calls
    ``materialize_buffers(device)`` once the weights are real.
    """

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or rotary_dim_of(hf_config, head_dim)
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim={head_dim}")
        self.max_positions = max_positions
        # Plain attributes, not buffers: model.to(dtype) must not round the frequencies.
        self._inv_freq, self.attention_scaling = compute_inv_freq(
            hf_config, head_dim, self.rotary_dim, max_positions)
        # [max_positions, rotary_dim]: cos in the first half, sin in the second.
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, self.rotary_dim),
                             persistent=False)

    @torch.no_grad()
    def materialize_buffers(self, device: torch.device) -> None:
        """Fill the cos/sin cache on ``device``, in fp32 first and then the buffer's dtype."""
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, self._inv_freq)  # [max_positions, rotary_dim // 2]
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling
        dtype = self.cos_sin_cache.dtype
        self.cos_sin_cache = cos_sin.to(device=device, dtype=dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim // 2]
        half = self.rotary_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half:self.rotary_dim]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)

    def _kernel_fits(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        # In place needs the result dtype to be q's: torch would promote to the cache's dtype.
        return (q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1
                and q.dtype == k.dtype == self.cos_sin_cache.dtype and self.cos_sin_cache.stride(-1) == 1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``(q, k)``. On CUDA a Triton kernel rotates them in place (same rounding as
        the torch code, which runs elsewhere and for layouts the kernel does not take)."""
        if use_triton(q) and self._kernel_fits(q, k):
            return triton_module("triton_layers").rotary_triton(positions, q, k, self.cos_sin_cache)
        cos_sin = self.cos_sin_cache[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        cos, sin = cos_sin.chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate_in_place(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """``forward``'s rotation written into ``q`` and ``k``, which may be views (the rope part of
        wider heads, so the caller keeps its whole heads and concatenates nothing). The Triton
        kernel rotates in place already; the torch code's result is copied back."""
        for x, rotated in zip((q, k), self.forward(positions, q, k)):
            if rotated is not x:
                x.copy_(rotated)

    def _norms_fit(self, q: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module) -> bool:
        # The fused kernel knows exactly these two norm classes (not subclasses: they may
        # override the maths); it normalises over the whole head and writes into q's dtype.
        norm_class = type(q_norm)
        if norm_class not in (RMSNorm, ZeroCenteredRMSNorm) or type(k_norm) is not norm_class:
            return False
        q_weight, k_weight = q_norm.weight, k_norm.weight
        head_dim = q.shape[-1]
        if (q_norm.eps != k_norm.eps or q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)
                or q_weight.dtype != k_weight.dtype):
            return False
        # RMSNorm's result has dtype promote(weight, x): in place needs that to stay q's dtype.
        return norm_class is ZeroCenteredRMSNorm or torch.promote_types(q_weight.dtype, q.dtype) == q.dtype

    def forward_with_norms(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        q_norm: nn.Module,  # per-head norm over head_dim
        k_norm: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self.forward(positions, q_norm(q), k_norm(k))`` (Qwen3's q/k norms before RoPE).

        On CUDA, when both norms are ``RMSNorm`` or both ``ZeroCenteredRMSNorm`` with one eps,
        a single Triton kernel normalises and rotates q and k in place (same roundings).
        """
        if use_triton(q) and self._kernel_fits(q, k) and self._norms_fit(q, q_norm, k_norm):
            return triton_module("triton_layers").qk_norm_rope_triton(
                positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.cos_sin_cache,
                self.rotary_dim, zero_centered=type(q_norm) is ZeroCenteredRMSNorm)
        return self.forward(positions, q_norm(q), k_norm(k))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_positions={self.max_positions}"


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """RoPE on interleaved pairs ``(x0, x1), (x2, x3), ...`` of the first ``rotary_dim`` dims
    (DeepSeek's MLA, ``rope_interleave``), returned de-interleaved as ``[even' | odd']``, as
    transformers' ``apply_rotary_pos_emb_interleave`` returns it (same operations, same rounding).
    Queries and keys both come out in that order, so their dot products are the interleaved ones.
    On CUDA the Triton rotary kernel does it in place in one launch (torch spends about fifteen),
    for the layouts it takes; torch ops elsewhere.
    """

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim // 2]
        rotary = x[..., :self.rotary_dim]
        x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(q) and self._kernel_fits(q, k):
            return triton_module("triton_layers").rotary_triton(positions, q, k, self.cos_sin_cache,
                                                                interleaved=True)
        cos_sin = self.cos_sin_cache[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        cos, sin = cos_sin.chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def forward_with_norms(self, positions, q, k, q_norm, k_norm):
        return self.forward(positions, q_norm(q), k_norm(k))
