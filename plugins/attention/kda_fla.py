"""Kimi Delta Attention on CUDA: fla-core's kernels for the delta rule, Weir's Gated DeltaNet
kernels for the short convs (KDA's three depthwise convs are one conv over the q|k|v channels).

- A decode-only step (``max_query_len == 1``, also inside CUDA graphs) runs Weir's slot-indexed
  conv update (``gdn_triton_kernels.conv_decode_step``), then fla's ``fused_recurrent_kda_fwd``
  in place on the recurrent-state pool (``ssm_state_indices`` = the slots), with no host reads
  and no value-dependent allocations.
- Any other step (prefill, chunked prefill, mixed) runs its leading one-token requests (the
  running decodes: the scheduler puts them first) through that decode path, and flattens the
  rest into one varlen sequence: Weir's varlen conv (``gdn_triton_prefill.conv_prefill``, in
  place on the conv slots, q and k L2-normalised), then fla's ``chunk_kda`` on recurrent states
  gathered from their slots, whose final states are scattered back. The step metadata is
  ``gdn_fla``'s (leading decodes, cu_seqlens on both sides, the chunk table).

fla-core (0.6.0) is imported lazily: importing this module neither imports fla nor touches CUDA.
"""

from __future__ import annotations

import torch

from weir.linear_attention import (
    KimiDeltaAttentionBackend,
    KimiDeltaAttentionLayerSpec,
    LayerState,
    LinearAttentionMetadata,
)
from weir.plugins.attention.gdn_fla import FLA_CHUNK_SIZE, FlaGDNBackend, FlaGDNMetadata
from weir.plugins.attention.gdn_triton_kernels import conv_decode_step
from weir.plugins.attention.gdn_triton_prefill import conv_prefill
from weir.plugins.attention.kda_torch import check_shapes

MAX_HEAD_DIM = 256  # fla's chunk_kda asserts K <= 256


class FlaKDABackend(KimiDeltaAttentionBackend):
    """Kimi Delta Attention over slot-indexed states: fla's chunk and fused recurrent kernels."""

    name = "kda_fla"
    supported_devices = frozenset({"cuda"})
    supports_cuda_graphs = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """A message when fla-core's KDA kernels cannot be imported (imports them: call lazily)."""
        try:
            import fla.ops.kda  # noqa: F401
            import fla.ops.kda.fused_recurrent  # noqa: F401
        except Exception as error:  # a broken install (not only a missing one) makes it unusable too
            return (f"fla-core cannot be imported ({type(error).__name__}: {error}); install fla-core==0.6.0 "
                    f"and packaging, or choose another Kimi Delta Attention backend (kda_torch)")
        return None

    def allocate_state(self, num_slots: int, layer: KimiDeltaAttentionLayerSpec) -> LayerState:
        """The base class's zeroed pools, after refusing shapes fla's kernels cannot run."""
        if layer.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"the kda_fla backend supports head_dim <= {MAX_HEAD_DIM}, got {layer.head_dim}")
        return super().allocate_state(num_slots, layer)

    def build_metadata(self, metadata: LinearAttentionMetadata) -> FlaGDNMetadata:
        """``gdn_fla``'s: decode steps keep the common fields; others add the leading decodes and
        the int64 slots, cu_seqlens and chunk table of the requests after them."""
        return FlaGDNBackend.build_metadata(self, metadata)

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
        """Decode kernels when every request has one token, fla's chunk kernel otherwise."""
        check_shapes(layer, mixed_qkv, g, beta, conv_weight, state)  # host shapes only: no sync
        if not isinstance(metadata, FlaGDNMetadata):
            metadata = self.build_metadata(metadata)
        num_rows, num_tokens = mixed_qkv.shape[0], metadata.num_tokens
        if num_tokens == 0 or metadata.num_reqs == 0:
            return mixed_qkv.new_zeros(num_rows, layer.num_heads, layer.head_dim)
        if metadata.max_query_len == 1:
            if num_tokens != metadata.num_reqs:
                raise ValueError(f"a decode step (max_query_len 1) needs one token per request, got "
                                 f"{num_tokens} tokens for {metadata.num_reqs} requests")
            out = self._decode(layer, mixed_qkv[:num_tokens], g[:num_tokens], beta[:num_tokens], conv_weight,
                               state, metadata.state_indices[:num_tokens])
        elif metadata.num_decode_reqs == 0:
            out = self._chunked(layer, mixed_qkv[:num_tokens], g[:num_tokens], beta[:num_tokens], conv_weight,
                                state, metadata)
        else:  # mixed: the leading decodes by the decode path, the rest by fla's chunk kernel
            first = metadata.num_decode_reqs
            out = mixed_qkv.new_empty(num_tokens, layer.num_heads, layer.head_dim)
            out[:first] = self._decode(layer, mixed_qkv[:first], g[:first], beta[:first], conv_weight, state,
                                       metadata.state_indices[:first])
            out[first:] = self._chunked(layer, mixed_qkv[first:num_tokens], g[first:num_tokens],
                                        beta[first:num_tokens], conv_weight, state, metadata)
        if num_rows > num_tokens:  # padded rows: zeros keep later ops finite
            out = torch.cat([out, out.new_zeros(num_rows - num_tokens, *out.shape[1:])])
        return out

    def _decode(self, layer, mixed_qkv, g, beta, conv_weight, state, slots) -> torch.Tensor:
        """One token per request (``mixed_qkv [B, 3HK]``, ``slots [B]`` int32): Weir's conv update,
        then fla's recurrent step in place on the pool; graph-capturable."""
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        num_reqs = mixed_qkv.shape[0]
        conv_out = torch.empty(num_reqs, layer.conv_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        conv_decode_step(mixed_qkv, state.conv_state, conv_weight, slots, conv_out)
        # fla indexes q, k and v as contiguous [B, T, H, K]: one copy makes the three parts so.
        q, k, v = conv_out.view(num_reqs, 3, 1, layer.num_heads, layer.head_dim).transpose(0, 1).contiguous()
        out, _ = fused_recurrent_kda_fwd(
            q=q, k=k, v=v, g=g.contiguous().unsqueeze(1), beta=beta.contiguous().unsqueeze(1),
            scale=layer.head_dim ** -0.5, initial_state=state.recurrent_state, inplace_final_state=True,
            ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
        )  # [B, 1, H, K]; the slots of recurrent_state hold the new states
        return out[:, 0]

    def _chunked(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata) -> torch.Tensor:
        """The chunk requests' tokens (``mixed_qkv [T, 3HK]``, rows may be strided): Weir's varlen
        conv in place on their slots, then fla's chunk kernel over gathered states."""
        from fla.ops.kda import chunk_kda

        # Eager steps have no padding requests, so slots are distinct (warm-up's fake requests all
        # share the padding slot, whose contents nothing reads).
        slots = metadata.state_slots
        q, k, v = conv_prefill(
            mixed_qkv, state.conv_state, conv_weight, slots, metadata.cu_seqlens, metadata.chunk_indices,
            num_k_heads=layer.num_heads, head_k_dim=layer.head_dim, num_v_heads=layer.num_heads,
            head_v_dim=layer.head_dim, chunk_size=FLA_CHUNK_SIZE,
        )  # q, k [T, H, K] L2-normalised, v [T, H, K]: contiguous
        core_out, recurrent_final = chunk_kda(
            q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
            scale=layer.head_dim ** -0.5,
            initial_state=state.recurrent_state.index_select(0, slots).float(),  # [num_reqs, H, K, K] fp32
            output_final_state=True, use_qk_l2norm_in_kernel=False, chunk_size=FLA_CHUNK_SIZE,
            cu_seqlens=metadata.cu_seqlens, cu_seqlens_cpu=metadata.cu_seqlens_cpu,
        )  # [1, T, H, K], [num_reqs, H, K, K] fp32
        state.recurrent_state.index_copy_(0, slots, recurrent_final.to(state.recurrent_state.dtype))
        return core_out[0]
