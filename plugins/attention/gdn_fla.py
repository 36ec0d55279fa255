"""Gated DeltaNet on CUDA: fla-core's chunk kernel for prefill, Weir's own kernels for decode and
for the prefill conv.

- A decode-only step (``max_query_len == 1``, also inside CUDA graphs) runs the two slot-indexed
  Triton kernels of ``gdn_triton_kernels``: conv update, then one delta-rule step, both in place
  on the state pools, with no host reads and no value-dependent allocations.
- Any other step (prefill, chunked prefill, mixed) runs its leading one-token requests (the
  running decodes: the scheduler puts them first) through those same decode kernels, and
  flattens the rest into one varlen sequence: Weir's varlen conv (``gdn_triton_prefill``, in
  place on the conv slots, q and k normalised in separate buffers), then fla's
  ``chunk_gated_delta_rule`` on recurrent states gathered from their slots, whose final states
  are scattered back. Keeping decodes out of the chunk path spares them the gather, fla's copy
  and the scatter of their whole state (about 4 MiB per request and layer at Qwen3-Next shapes).

fla-core (0.6.0) is imported lazily: importing this module neither imports fla nor touches CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from weir.buffers.staged_write import host_to_device
from weir.linear_attention import GatedDeltaNetLayerSpec, LayerState, LinearAttentionBackend, LinearAttentionMetadata
from weir.plugins.attention.gdn_triton_kernels import conv_decode_step, gdn_decode_step
from weir.plugins.attention.gdn_triton_prefill import conv_prefill

# fla's chunk length; Weir's prefill conv tiles tokens by the same chunks, so one chunk table
# serves both.
FLA_CHUNK_SIZE = 64
MAX_HEAD_K_DIM = 256  # fla's chunk_gated_delta_rule_fwd_h asserts K <= 256


@dataclass
class FlaGDNMetadata(LinearAttentionMetadata):
    """The common step metadata plus what fla's varlen kernels need, derived once per step.

    The first ``num_decode_reqs`` requests (one token each) take the decode kernels; the varlen
    fields describe the remaining ``num_chunk_reqs`` requests, whose tokens start at row
    ``num_decode_reqs``. All extras stay at their defaults for decode-only steps.
    """

    num_decode_reqs: int = 0
    state_slots: torch.Tensor | None = None  # [num_chunk_reqs] int64, device: slots for gather/scatter
    cu_seqlens: torch.Tensor | None = None  # [num_chunk_reqs + 1] int64, device, from 0
    cu_seqlens_cpu: torch.Tensor | None = None  # [num_chunk_reqs + 1] int64, CPU
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
        """Decode steps: the common fields only. Others: the leading decodes, then int64 slots,
        cu_seqlens and the chunk table of the requests after them."""
        common = {field.name: getattr(metadata, field.name) for field in fields(LinearAttentionMetadata)}
        if metadata.max_query_len == 1:
            return FlaGDNMetadata(**common)
        query_start_loc_cpu = metadata.query_start_loc_cpu
        if query_start_loc_cpu is None:  # not an expected caller: one sync per step, not per layer
            query_start_loc_cpu = metadata.query_start_loc.cpu()
        query_start_loc_cpu = query_start_loc_cpu.to(torch.int64)
        query_lens = np.diff(query_start_loc_cpu.numpy())  # [num_reqs]
        # Leading one-token requests; at least one multi-token request follows (max_query_len > 1).
        num_decode_reqs = int(np.argmax(query_lens != 1))
        cu_seqlens_cpu = query_start_loc_cpu[num_decode_reqs:] - num_decode_reqs  # token row = request here
        device = metadata.query_start_loc.device
        chunk_table = chunk_indices_from_query_start_loc(cu_seqlens_cpu.numpy(), FLA_CHUNK_SIZE)
        return FlaGDNMetadata(
            **common,
            num_decode_reqs=num_decode_reqs,
            state_slots=metadata.state_indices[num_decode_reqs: metadata.num_reqs].to(torch.int64),
            # A fresh tensor every step: fla caches derived tables by tensor identity.
            cu_seqlens=(metadata.query_start_loc[num_decode_reqs: metadata.num_reqs + 1] - num_decode_reqs
                        ).to(torch.int64),
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
            if num_tokens != metadata.num_reqs:
                raise ValueError(f"a decode step (max_query_len 1) needs one token per request, got "
                                 f"{num_tokens} tokens for {metadata.num_reqs} requests")
            out = self._decode(layer, mixed_qkv[:num_tokens], g, beta, conv_weight, state,
                               metadata.state_indices[:num_tokens])
        elif metadata.num_decode_reqs == 0:
            out = self._chunked(layer, mixed_qkv[:num_tokens], g[:num_tokens], beta[:num_tokens], conv_weight,
                                state, metadata)
        else:  # mixed: the leading decodes by the decode kernels, the rest by fla's chunk kernels
            first_chunk_row = metadata.num_decode_reqs
            out = mixed_qkv.new_empty(num_tokens, layer.num_v_heads, layer.head_v_dim)
            out[:first_chunk_row] = self._decode(layer, mixed_qkv[:first_chunk_row], g, beta, conv_weight, state,
                                                 metadata.state_indices[:first_chunk_row])
            out[first_chunk_row:] = self._chunked(
                layer, mixed_qkv[first_chunk_row:num_tokens], g[first_chunk_row:num_tokens],
                beta[first_chunk_row:num_tokens], conv_weight, state, metadata)
        if num_rows > num_tokens:  # padded rows: zeros keep later ops finite
            out = torch.cat([out, out.new_zeros(num_rows - num_tokens, *out.shape[1:])])
        return out

    def _decode(self, layer, mixed_qkv, g, beta, conv_weight, state, slots) -> torch.Tensor:
        """One token per request (``mixed_qkv [B, conv_dim]``, ``slots [B]`` int32): Weir's
        slot-indexed kernels, in place, graph-capturable."""
        num_reqs = mixed_qkv.shape[0]
        conv_out = torch.empty(num_reqs, layer.conv_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        conv_decode_step(mixed_qkv, state.conv_state, conv_weight, slots, conv_out)
        out = torch.empty(num_reqs, layer.num_v_heads, layer.head_v_dim, dtype=mixed_qkv.dtype,
                          device=mixed_qkv.device)
        return gdn_decode_step(conv_out, g[:num_reqs], beta[:num_reqs], state.recurrent_state, slots, out,
                               num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim)

    def _chunked(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata) -> torch.Tensor:
        """The chunk requests' tokens (``mixed_qkv [T, conv_dim]``, rows may be strided): Weir's
        varlen conv in place on their slots, then fla's chunk kernel over gathered states."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        # Eager steps have no padding requests, so slots are distinct (warm-up's fake requests all
        # share the padding slot, whose contents nothing reads).
        slots = metadata.state_slots
        q, k, v = conv_prefill(
            mixed_qkv, state.conv_state, conv_weight, slots, metadata.cu_seqlens, metadata.chunk_indices,
            num_k_heads=layer.num_k_heads, head_k_dim=layer.head_k_dim, num_v_heads=layer.num_v_heads,
            head_v_dim=layer.head_v_dim, chunk_size=FLA_CHUNK_SIZE,
        )  # q, k [T, H, Dk] L2-normalised, v [T, HV, Dv]: contiguous, so fla copies none of them
        # Keywords only: fla's GDN entry points differ in where g and beta sit positionally.
        core_out, recurrent_final = chunk_gated_delta_rule(
            q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
            scale=layer.head_k_dim ** -0.5,
            initial_state=state.recurrent_state.index_select(0, slots).float(),  # [num_reqs, HV, Dk, Dv] fp32
            output_final_state=True, use_qk_l2norm_in_kernel=False, chunk_size=FLA_CHUNK_SIZE,
            cu_seqlens=metadata.cu_seqlens, cu_seqlens_cpu=metadata.cu_seqlens_cpu,
            chunk_indices=metadata.chunk_indices,
        )  # [1, T, HV, Dv], [num_reqs, HV, Dk, Dv] fp32
        state.recurrent_state.index_copy_(0, slots, recurrent_final.to(state.recurrent_state.dtype))
        return core_out[0]  # fla's own buffer: no copy
