"""Gated DeltaNet one request and one token at a time, straight from the contract in
``weir.linear_attention.LinearAttentionBackend``: slow, short, and easy to check."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weir.linear_attention import GatedDeltaNetLayerSpec, LayerState, LinearAttentionBackend, LinearAttentionMetadata


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class NaiveGDNBackend(LinearAttentionBackend):
    name = "gdn_naive"
    supported_devices = frozenset({"cpu"})

    def forward(
        self,
        layer: GatedDeltaNetLayerSpec,
        mixed_qkv: torch.Tensor,  # [num_tokens, conv_dim] pre-conv q | k | v channels
        g: torch.Tensor,  # [num_tokens, num_v_heads] fp32 log-decay
        beta: torch.Tensor,  # [num_tokens, num_v_heads]
        conv_weight: torch.Tensor,  # [conv_dim, conv_kernel]
        state: LayerState,
        metadata: LinearAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_v_heads, head_v_dim] in the model dtype
        heads_per_k_head = layer.num_v_heads // layer.num_k_heads
        out = mixed_qkv.new_zeros(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim)
        starts = metadata.query_start_loc.tolist()
        slots = metadata.state_indices.tolist()
        weight = conv_weight.float()
        for request in range(metadata.num_reqs):
            slot = slots[request]
            window = state.conv_state[slot]  # [conv_dim, conv_kernel], oldest input first
            recurrent = state.recurrent_state[slot].float()  # [num_v_heads, head_k_dim, head_v_dim]
            for token in range(starts[request], starts[request + 1]):
                window = torch.cat([window[:, 1:], mixed_qkv[token, :, None].to(window.dtype)], dim=1)
                conv_out = F.silu((window.float() * weight).sum(dim=1)).to(mixed_qkv.dtype).float()
                q, k, v = conv_out.split([layer.key_dim, layer.key_dim, layer.value_dim])
                q = _l2_normalize(q.view(layer.num_k_heads, -1)).repeat_interleave(heads_per_k_head, dim=0)
                k = _l2_normalize(k.view(layer.num_k_heads, -1)).repeat_interleave(heads_per_k_head, dim=0)
                q = q * layer.head_k_dim ** -0.5  # [num_v_heads, head_k_dim]
                v = v.view(layer.num_v_heads, layer.head_v_dim)
                recurrent = recurrent * g[token].float().exp()[:, None, None]
                recalled = torch.einsum("hk,hkv->hv", k, recurrent)  # what the state holds for k
                correction = beta[token].float()[:, None] * (v - recalled)
                recurrent = recurrent + k[:, :, None] * correction[:, None, :]
                out[token] = torch.einsum("hk,hkv->hv", q, recurrent).to(out.dtype)
            state.conv_state[slot] = window
            state.recurrent_state[slot] = recurrent.to(state.recurrent_state.dtype)
        return out
