"""Gated DeltaNet on CUDA: fla-core's chunked kernels for prefill, Weir's own kernels for decode.

- A decode-only step (``max_query_len == 1``, also inside CUDA graphs) runs the two slot-indexed
  Triton kernels of ``gdn_triton_kernels``: conv update, then one delta-rule step, both in place
  on the state pools, with no host reads and no value-dependent allocations.
- Any other step (prefill, chunked prefill, mixed) flattens the batch into one varlen sequence
  and runs fla's ``causal_conv1d`` and ``chunk_gated_delta_rule`` on states gathered from the
  request slots, then scatters the final states back.

fla-core (0.6.0) is imported lazily: importing this module neither imports fla nor touches CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from weir.linear_attention import GatedDeltaNetLayerSpec, LayerState, LinearAttentionBackend, LinearAttentionMetadata
from weir.plugins.attention.gdn_triton_kernels import conv_decode_step, gdn_decode_step
from weir.runner.staged_write import host_to_device

# fla's chunk length. causal_conv1d always tiles by 64 (it does not forward a chunk size), so one
# chunk-index table serves both kernels only while the GDN chunk stays 64 too.
FLA_CHUNK_SIZE = 64
MAX_HEAD_K_DIM = 256  # fla's chunk_gated_delta_rule_fwd_h asserts K <= 256


@dataclass
class FlaGDNMetadata(LinearAttentionMetadata):
    """The common step metadata plus what fla's varlen kernels need, derived once per step.

    All extras stay None for decode-only steps, which need nothing beyond the common fields.
    """

    state_slots: torch.Tensor | None = None  # [num_reqs] int64, device: slots for gather/scatter
    cu_seqlens: torch.Tensor | None = None  # [num_reqs + 1] int64, device
    cu_seqlens_cpu: torch.Tensor | None = None  # [num_reqs + 1] int64, CPU
    chunk_indices: torch.Tensor | None = None  # [num_chunks, 2] int64, device: (request, chunk of it)


def chunk_indices_from_query_start_loc(query_start_loc_cpu: np.ndarray, chunk_size: int) -> np.ndarray:
    """fla's varlen chunk table: one ``(request, chunk index within the request)`` row per chunk.

    The same table fla's ``prepare_chunk_indices`` builds, but from host values, so fla never
    has to read ``cu_seqlens`` back from the device.
    """
    lengths = np.diff(query_start_loc_cpu.astype(np.int64))  # [num_reqs]
    chunks_per_request = (lengths + chunk_size - 1) // chunk_size  # [num_reqs]
    request_of_chunk = np.repeat(np.arange(len(lengths), dtype=np.int64), chunks_per_request)  # [num_chunks]
    first_chunk = np.cumsum(chunks_per_request) - chunks_per_request  # [num_reqs]
    chunk_in_request = np.arange(len(request_of_chunk), dtype=np.int64) - first_chunk[request_of_chunk]
    return np.stack([request_of_chunk, chunk_in_request], axis=1)  # [num_chunks, 2]


class FlaGDNBackend(LinearAttentionBackend):
    """Gated DeltaNet over slot-indexed states: fla chunk kernels + Weir's decode kernels."""

    name = "gdn_fla"
    supported_devices = frozenset({"cuda"})
    supports_cuda_graphs = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """A message when fla-core's kernels cannot be imported (imports them: call lazily)."""
        try:
            import fla.modules.causal_conv1d  # noqa: F401
            import fla.ops.gated_delta_rule  # noqa: F401
        except Exception as error:  # a broken install (not only a missing one) makes it unusable too
            return (f"fla-core cannot be imported ({type(error).__name__}: {error}); install fla-core==0.6.0 "
                    f"and packaging, or choose another Gated DeltaNet backend")
        return None

    def allocate_state(self, num_slots: int, layer: GatedDeltaNetLayerSpec) -> LayerState:
        """The base class's zeroed pools, after refusing shapes fla's kernels cannot run."""
        if layer.head_k_dim > MAX_HEAD_K_DIM:
            raise ValueError(f"the gdn_fla backend supports head_k_dim <= {MAX_HEAD_K_DIM}, got {layer.head_k_dim}")
        return super().allocate_state(num_slots, layer)

    def build_metadata(self, metadata: LinearAttentionMetadata) -> FlaGDNMetadata:
        """Decode steps: the common fields only. Others: int64 slots, cu_seqlens, chunk table."""
        common = {field.name: getattr(metadata, field.name) for field in fields(LinearAttentionMetadata)}
        if metadata.max_query_len == 1:
            return FlaGDNMetadata(**common)
        query_start_loc_cpu = metadata.query_start_loc_cpu
        if query_start_loc_cpu is None:  # not an expected caller: one sync per step, not per layer
            query_start_loc_cpu = metadata.query_start_loc.cpu()
        cu_seqlens_cpu = query_start_loc_cpu.to(torch.int64)
        device = metadata.query_start_loc.device
        chunk_table = chunk_indices_from_query_start_loc(cu_seqlens_cpu.numpy(), FLA_CHUNK_SIZE)
        return FlaGDNMetadata(
            **common,
            state_slots=metadata.state_indices.to(torch.int64),
            # A fresh tensor every step: fla caches derived tables by tensor identity.
            cu_seqlens=metadata.query_start_loc.to(torch.int64, copy=True),
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=host_to_device(chunk_table, device, pin_memory=device.type == "cuda"),
        )

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
        """Decode kernels when every request has one token, fla's chunk kernels otherwise."""
        if not isinstance(metadata, FlaGDNMetadata):
            metadata = self.build_metadata(metadata)
        num_rows, num_tokens = mixed_qkv.shape[0], metadata.num_tokens
        if num_tokens == 0 or metadata.num_reqs == 0:
            return mixed_qkv.new_zeros(num_rows, layer.num_v_heads, layer.head_v_dim)
        if metadata.max_query_len == 1:
            out = self._decode(layer, mixed_qkv, g, beta, conv_weight, state, metadata)
        else:
            out = self._chunked(layer, mixed_qkv, g, beta, conv_weight, state, metadata)
        if num_rows > num_tokens:  # padded rows: zeros keep later ops finite
            out = torch.cat([out, out.new_zeros(num_rows - num_tokens, *out.shape[1:])])
        return out

    def _decode(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata) -> torch.Tensor:
        """One token per request: Weir's slot-indexed kernels, in place, graph-capturable."""
        num_reqs = metadata.num_reqs
        if metadata.num_tokens != num_reqs:
            raise ValueError(f"a decode step (max_query_len 1) needs one token per request, got "
                             f"{metadata.num_tokens} tokens for {num_reqs} requests")
        conv_out = torch.empty(num_reqs, layer.conv_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        conv_decode_step(mixed_qkv[:num_reqs], state.conv_state, conv_weight, metadata.state_indices, conv_out)
        out = torch.empty(num_reqs, layer.num_v_heads, layer.head_v_dim, dtype=mixed_qkv.dtype,
                          device=mixed_qkv.device)
        return gdn_decode_step(conv_out, g[:num_reqs], beta[:num_reqs], state.recurrent_state,
                               metadata.state_indices, out, num_k_heads=layer.num_k_heads,
                               head_k_dim=layer.head_k_dim)

    def _chunked(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata) -> torch.Tensor:
        """Prefill or mixed steps: fla's varlen conv and chunk kernels over gathered slot states."""
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        num_tokens = metadata.num_tokens
        slots = metadata.state_slots  # eager steps: no padding requests, so slots are distinct
        varlen = dict(cu_seqlens=metadata.cu_seqlens, cu_seqlens_cpu=metadata.cu_seqlens_cpu,
                      chunk_indices=metadata.chunk_indices)

        conv_out, conv_final = causal_conv1d(
            x=mixed_qkv[:num_tokens].contiguous().unsqueeze(0), weight=conv_weight,
            initial_state=state.conv_state.index_select(0, slots),  # [num_reqs, conv_dim, conv_kernel]
            output_final_state=True, activation="silu", **varlen,
        )  # [1, num_tokens, conv_dim], [num_reqs, conv_dim, conv_kernel]
        state.conv_state.index_copy_(0, slots, conv_final)

        key_dim = layer.key_dim
        q = conv_out[..., :key_dim].unflatten(-1, (layer.num_k_heads, layer.head_k_dim))  # [1, T, H, Dk]
        k = conv_out[..., key_dim:2 * key_dim].unflatten(-1, (layer.num_k_heads, layer.head_k_dim))
        v = conv_out[..., 2 * key_dim:].unflatten(-1, (layer.num_v_heads, layer.head_v_dim))  # [1, T, HV, Dv]
        # Keywords only: fla's GDN entry points differ in where g and beta sit positionally.
        core_out, recurrent_final = chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g[:num_tokens].unsqueeze(0), beta=beta[:num_tokens].unsqueeze(0),
            scale=layer.head_k_dim ** -0.5,
            initial_state=state.recurrent_state.index_select(0, slots).float(),  # [num_reqs, HV, Dk, Dv] fp32
            output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=FLA_CHUNK_SIZE, **varlen,
        )  # [1, T, HV, Dv], [num_reqs, HV, Dk, Dv] fp32
        state.recurrent_state.index_copy_(0, slots, recurrent_final.to(state.recurrent_state.dtype))
        return core_out[0]  # fla's own buffer: no copy
