"""Reference Kimi Delta Attention backend over per-request state slots, in plain torch ops.

It runs on every platform and is the oracle the fast backends are tested against, so it
favours obvious correctness: prefill requests run one at a time through the chunked rule, and
all single-token (decode) requests of a step run as one batched recurrent update, gathered from
and scattered back to their slots. The maths lives in ``kda_torch_ops`` (the conv is Gated
DeltaNet's, shared from ``gdn_torch_ops``).
"""

from __future__ import annotations

import torch

from weir.linear_attention import (
    KimiDeltaAttentionBackend,
    KimiDeltaAttentionLayerSpec,
    LayerState,
    LinearAttentionMetadata,
)
from weir.plugins.attention.gdn_torch_ops import causal_conv1d_with_state
from weir.plugins.attention.kda_torch_ops import chunk_kda, recurrent_kda


class TorchKDABackend(KimiDeltaAttentionBackend):
    """Kimi Delta Attention in plain torch: per-request chunked prefill, batched recurrent decode."""

    name = "kda_torch"
    supported_devices = frozenset({"cpu", "cuda", "xpu"})
    supports_cuda_graphs = False

    def forward(
        self,
        layer: KimiDeltaAttentionLayerSpec,
        mixed_qkv: torch.Tensor,  # [num_tokens, 3 * H * K] pre-conv q|k|v channels, model dtype
        g: torch.Tensor,  # [num_tokens, H, K] fp32 log-decay per key channel (<= 0)
        beta: torch.Tensor,  # [num_tokens, H] in (0, 1)
        conv_weight: torch.Tensor,  # [3 * H * K, conv_kernel]
        state: LayerState,
        metadata: LinearAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, H, K] in the model dtype
        """Conv + SiLU, split, L2-norm, per-channel delta rule; updates the request slots in place."""
        check_shapes(layer, mixed_qkv, g, beta, conv_weight, state)
        num_reqs = metadata.num_reqs
        # The reference may read the device: one host sync per layer is fine here.
        host_starts = metadata.query_start_loc_cpu
        starts = (host_starts if host_starts is not None else metadata.query_start_loc)[: num_reqs + 1].tolist()
        slots = metadata.state_indices[:num_reqs].to(device=mixed_qkv.device, dtype=torch.long)  # [num_reqs]
        # Rows past the last request (padding tokens) stay zero.
        out = mixed_qkv.new_zeros(mixed_qkv.shape[0], layer.num_heads, layer.head_dim)

        decode_reqs = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
        if decode_reqs:
            rows = torch.tensor([starts[r] for r in decode_reqs], dtype=torch.long, device=mixed_qkv.device)
            out[rows] = self._run(layer, mixed_qkv[rows, None], g[rows, None], beta[rows, None],
                                  conv_weight, state, slots[decode_reqs])[:, 0]
        for r in range(num_reqs):
            start, end = starts[r], starts[r + 1]
            if end - start > 1:
                out[start:end] = self._run(layer, mixed_qkv[None, start:end], g[None, start:end],
                                           beta[None, start:end], conv_weight, state, slots[r : r + 1])[0]
        return out

    @staticmethod
    def _run(
        layer: KimiDeltaAttentionLayerSpec,
        mixed_qkv: torch.Tensor,  # [batch, seq_len, 3 * H * K]
        g: torch.Tensor,  # [batch, seq_len, H, K]
        beta: torch.Tensor,  # [batch, seq_len, H]
        conv_weight: torch.Tensor,  # [3 * H * K, conv_kernel]
        state: LayerState,
        slots: torch.Tensor,  # [batch] int64, distinct except for the padding slot
    ) -> torch.Tensor:  # [batch, seq_len, H, K]
        """One batch of equal-length requests: read their slots, run the layer, write the slots back."""
        batch, seq_len, _ = mixed_qkv.shape
        conv_out, new_conv_state = causal_conv1d_with_state(mixed_qkv, state.conv_state[slots], conv_weight)
        state.conv_state.index_copy_(0, slots, new_conv_state)

        head_shape = (batch, seq_len, layer.num_heads, layer.head_dim)
        q, k, v = (part.reshape(head_shape) for part in conv_out.split(layer.key_dim, dim=-1))
        delta_rule = recurrent_kda if seq_len == 1 else chunk_kda
        core_out, new_recurrent_state = delta_rule(q, k, v, g, beta, initial_state=state.recurrent_state[slots])
        state.recurrent_state.index_copy_(0, slots, new_recurrent_state.to(state.recurrent_state.dtype))
        return core_out


def check_shapes(layer: KimiDeltaAttentionLayerSpec, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 conv_weight: torch.Tensor, state: LayerState) -> None:
    """Fail loudly on a layer spec that does not match the tensors it is run with."""
    num_tokens = mixed_qkv.shape[0]
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != layer.conv_dim:
        raise ValueError(f"layer {layer.layer_idx}: mixed_qkv has shape {tuple(mixed_qkv.shape)}, "
                         f"expected [num_tokens, {layer.conv_dim}]")
    if tuple(g.shape) != (num_tokens, layer.num_heads, layer.head_dim):
        raise ValueError(f"layer {layer.layer_idx}: g has shape {tuple(g.shape)}, expected "
                         f"{(num_tokens, layer.num_heads, layer.head_dim)} (a decay per key channel)")
    if tuple(beta.shape) != (num_tokens, layer.num_heads):
        raise ValueError(f"layer {layer.layer_idx}: beta has shape {tuple(beta.shape)}, expected "
                         f"{(num_tokens, layer.num_heads)}")
    expected_weight = (layer.conv_dim, layer.conv_kernel)
    if tuple(conv_weight.shape) != expected_weight:
        raise ValueError(f"layer {layer.layer_idx}: conv_weight has shape {tuple(conv_weight.shape)}, "
                         f"expected {expected_weight}")
    if (tuple(state.recurrent_state.shape[1:]) != layer.recurrent_state_shape
            or tuple(state.conv_state.shape[1:]) != expected_weight):
        raise ValueError(f"layer {layer.layer_idx}: state shapes {tuple(state.conv_state.shape)}, "
                         f"{tuple(state.recurrent_state.shape)} do not match the layer spec")
