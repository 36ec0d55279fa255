"""Reference Gated DeltaNet backend over per-request state slots, in plain torch ops.

It runs on every platform and is the oracle the fast backends are tested against, so it
favours obvious correctness: prefill requests run one at a time through the chunked delta rule,
and all single-token (decode) requests of a step run as one batched recurrent update, gathered
from and scattered back to their slots. The maths lives in ``gdn_torch_ops``.
"""

from __future__ import annotations

import torch

from weir.linear_attention import GatedDeltaNetLayerSpec, LayerState, LinearAttentionBackend, LinearAttentionMetadata
from weir.plugins.attention.gdn_torch_ops import (
    causal_conv1d_with_state,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


class TorchGDNBackend(LinearAttentionBackend):
    """Gated DeltaNet in plain torch: per-request chunked prefill, batched recurrent decode."""

    name = "gdn_torch"
    supported_devices = frozenset({"cpu", "cuda", "xpu"})
    supports_cuda_graphs = False

    def forward(
        self,
        layer: GatedDeltaNetLayerSpec,
        mixed_qkv: torch.Tensor,  # [num_tokens, conv_dim] pre-conv q|k|v channels, model dtype
        g: torch.Tensor,  # [num_tokens, num_v_heads] fp32 log-decay (<= 0)
        beta: torch.Tensor,  # [num_tokens, num_v_heads] in (0, 1)
        conv_weight: torch.Tensor,  # [conv_dim, conv_kernel]
        state: LayerState,
        metadata: LinearAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_v_heads, head_v_dim] in the model dtype
        """Conv + SiLU, split, L2-norm, gated delta rule; updates the request slots in place."""
        _check_shapes(layer, mixed_qkv, conv_weight, state)
        num_reqs = metadata.num_reqs
        # The reference may read the device: one host sync per layer is fine here.
        host_starts = metadata.query_start_loc_cpu
        starts = (host_starts if host_starts is not None else metadata.query_start_loc)[: num_reqs + 1].tolist()
        slots = metadata.state_indices[:num_reqs].to(device=mixed_qkv.device, dtype=torch.long)  # [num_reqs]
        # Rows past the last request (padding tokens) stay zero.
        out = mixed_qkv.new_zeros(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim)

        decode_reqs = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
        if decode_reqs:
            rows = torch.tensor([starts[r] for r in decode_reqs], dtype=torch.long, device=mixed_qkv.device)
            req_slots = slots[decode_reqs]  # [num_decodes]
            out[rows] = self._run(layer, mixed_qkv[rows, None], g[rows, None], beta[rows, None],
                                  conv_weight, state, req_slots)[:, 0]
        for r in range(num_reqs):
            start, end = starts[r], starts[r + 1]
            if end - start > 1:
                out[start:end] = self._run(layer, mixed_qkv[None, start:end], g[None, start:end],
                                           beta[None, start:end], conv_weight, state, slots[r : r + 1])[0]
        return out

    @staticmethod
    def _run(
        layer: GatedDeltaNetLayerSpec,
        mixed_qkv: torch.Tensor,  # [batch, seq_len, conv_dim]
        g: torch.Tensor,  # [batch, seq_len, num_v_heads]
        beta: torch.Tensor,  # [batch, seq_len, num_v_heads]
        conv_weight: torch.Tensor,  # [conv_dim, conv_kernel]
        state: LayerState,
        slots: torch.Tensor,  # [batch] int64, distinct except for the padding slot
    ) -> torch.Tensor:  # [batch, seq_len, num_v_heads, head_v_dim]
        """One batch of equal-length requests: read their slots, run the layer, write the slots back."""
        batch, seq_len, _ = mixed_qkv.shape
        conv_out, new_conv_state = causal_conv1d_with_state(mixed_qkv, state.conv_state[slots], conv_weight)
        state.conv_state.index_copy_(0, slots, new_conv_state)

        q, k, v = conv_out.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        q = q.reshape(batch, seq_len, layer.num_k_heads, layer.head_k_dim)
        k = k.reshape(batch, seq_len, layer.num_k_heads, layer.head_k_dim)
        v = v.reshape(batch, seq_len, layer.num_v_heads, layer.head_v_dim)
        delta_rule = recurrent_gated_delta_rule if seq_len == 1 else chunk_gated_delta_rule
        core_out, new_recurrent_state = delta_rule(q, k, v, g, beta, initial_state=state.recurrent_state[slots])
        state.recurrent_state.index_copy_(0, slots, new_recurrent_state.to(state.recurrent_state.dtype))
        return core_out


def _check_shapes(
    layer: GatedDeltaNetLayerSpec, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, state: LayerState
) -> None:
    """Fail loudly on a layer spec that does not match the tensors it is run with."""
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != layer.conv_dim:
        raise ValueError(f"layer {layer.layer_idx}: mixed_qkv has shape {tuple(mixed_qkv.shape)}, "
                         f"expected [num_tokens, {layer.conv_dim}]")
    expected_weight = (layer.conv_dim, layer.conv_kernel)
    if tuple(conv_weight.shape) != expected_weight:
        raise ValueError(f"layer {layer.layer_idx}: conv_weight has shape {tuple(conv_weight.shape)}, "
                         f"expected {expected_weight}")
    expected_state = (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    if tuple(state.recurrent_state.shape[1:]) != expected_state or state.conv_state.shape[1:] != expected_weight:
        raise ValueError(f"layer {layer.layer_idx}: state shapes {tuple(state.conv_state.shape)}, "
                         f"{tuple(state.recurrent_state.shape)} do not match the layer spec")
