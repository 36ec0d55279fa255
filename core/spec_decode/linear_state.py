"""Linear-attention layers (Gated DeltaNet, Kimi Delta Attention) under verification: no state for rejected drafts.

A verifying request feeds ``1 + k`` tokens through a layer whose state is one slot per request;
run as one chunk, the slot would end holding the state after every draft, rejected ones too. So
a verify step runs such layers on a scratch copy of the verifying rows' states and leaves their
slots as they were; the slots move on once rejection sampling has said how many tokens each
request keeps (``commit``, on the device), by running those tokens again from the slot.

Per layer, in the forward:

1. rows without drafts of an eager step (prefill chunks, plain decodes) run in one call on their
   slots, as without speculation;
2. every other row (in a verify graph, every row) has its slot copied into the scratch state;
   for ``j = 0 .. width - 1`` the ``j``-th token of each such row runs as one decode batch on the
   scratch (a row with fewer tokens writes a dump row of the scratch there), and the tokens'
   layer inputs are kept for the commit.

At ``commit``: for ``j = 0 .. width - 1`` the kept inputs of position ``j`` run as a decode batch
on the slots, for the rows that keep more than ``j`` tokens (the others run on the padding slot:
every position runs, as the kept counts are known on the device only).

Why recompute and not a state per draft position: the inputs kept are a layer's pre-conv channels
and gates (tens of KiB per token: ``[width, max rows, ...]`` per layer, allocated once), where a
state is MiBs: per-position snapshots of every layer would cost ``k`` states per request and layer
for the step (GiBs at batch 256), and could not live in the fixed buffers a CUDA graph needs. The
scratch state is one layer's (``max rows`` slots), shared by all layers of a shape. Both are
allocated before the KV cache is sized (on an accelerator), so it counts them. The price is a
second decode pass over the kept positions.
Every call is a backend's decode path, which every linear-attention backend has, and every index
comes from device tensors in fixed buffers, so any backend serves verification unchanged, eager
or inside the verify-width CUDA graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from weir.buffers import host_to_device
from weir.linear_attention import LinearAttentionMetadata, copy_state_slots


@dataclass
class _Call:
    token_index: torch.Tensor  # [n] tokens of the step this call runs
    metadata: object  # the inner backend's metadata of the call


@dataclass
class VerifySplit:
    """How one verify step runs its linear-attention layers (host-known sizes)."""

    plain: _Call | None  # rows without drafts of an eager step, on their slots
    num_rows: int  # M: rows run per position on the scratch state
    width: int  # W: positions per row
    num_committed_rows: int  # the first rows that are real requests (a graph pads its batch)
    positions: list[object] | None = None  # [W] inner metadata of each position, once built


class VerifyBuffers:
    """Fixed device buffers of the verify path (a CUDA graph reads and writes these addresses)."""

    def __init__(self, max_rows: int, max_width: int, device: torch.device):
        def empty(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.batch_index = empty(max_rows, dtype=torch.int64)  # [M] batch position of each scratch row
        self.token_index = empty(max_width, max_rows, dtype=torch.int64)  # [W, M] step token at position j
        self.valid = empty(max_width, max_rows, dtype=torch.bool)  # [W, M] whether the row has a j-th token
        self.query_lens = empty(max_rows, dtype=torch.int64)  # [M]
        self.slots = empty(max_rows, dtype=torch.int64)  # [M] the rows' state slots
        self.scratch_rows = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # [M + 1]: rows, then dump
        # The decode calls' query_start_loc on the host too (one token a row), so that backends
        # that read it there (the torch references) need no sync.
        self.scratch_rows_cpu = torch.arange(max_rows + 1, dtype=torch.int32)
        self.arange = torch.arange(max_rows, dtype=torch.int64, device=device)


class SpeculativeStateBackend:
    """Wraps one linear-attention backend instance; everything but a verify step's forward is
    the inner backend's own."""

    def __init__(self, inner, rollback: "StateRollback"):
        self.inner = inner
        self.rollback = rollback
        self.split: VerifySplit | None = None  # set for each step by StateRollback.prepare

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def build_metadata(self, metadata: LinearAttentionMetadata):
        split = self.split
        if split is None:
            return self.inner.build_metadata(metadata)
        plain = split.plain
        if plain is not None:
            plain = _Call(plain.token_index, self.inner.build_metadata(plain.metadata))
        # Inside the forward (so inside a capture): the per-position indices from the step's
        # buffers. A copy per state kind: each kind's backend builds its own metadata.
        return dataclasses.replace(split, plain=plain,
                                   positions=self.rollback.position_metadata(self, metadata, split))

    def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata):
        split = metadata
        if not isinstance(split, VerifySplit):
            return self.inner.forward(layer, mixed_qkv, g, beta, conv_weight, state, metadata)
        out = None
        if split.plain is not None:
            index = split.plain.token_index
            result = self.inner.forward(layer, mixed_qkv[index], g[index], beta[index], conv_weight, state,
                                        split.plain.metadata)
            out = result.new_zeros(mixed_qkv.shape[0] + 1, *result.shape[1:])
            out[index] = result
        rollback, buffers, rows = self.rollback, self.rollback.buffers, split.num_rows
        scratch = rollback.scratch_of(layer)
        copy_state_slots(state, buffers.slots[:rows], scratch, buffers.arange[:rows])
        kept = rollback.kept_inputs(layer, conv_weight, mixed_qkv, g, beta)
        dump = mixed_qkv.shape[0]  # out's last row takes what padded positions give
        for j in range(split.width):
            token_index = buffers.token_index[j, :rows]
            inputs = [torch.index_select(source, 0, token_index, out=target[j, :rows])
                      for source, target in zip((mixed_qkv, g, beta), kept)]
            result = self.inner.forward(layer, *inputs, conv_weight, scratch, split.positions[j])
            if out is None:  # shaped after the first call's output: each layer kind has its own
                out = result.new_zeros(mixed_qkv.shape[0] + 1, *result.shape[1:])
            out.index_copy_(0, torch.where(buffers.valid[j, :rows], token_index, dump), result)
        return out[:-1]


class StateRollback:
    """Installs the wrappers on a runner's linear-attention backends and drives them per step."""

    def __init__(self, runner, num_speculative_tokens: int):
        self.runner = runner
        caches = runner.caches
        self.max_rows = runner.max_running_reqs
        self.max_width = 1 + num_speculative_tokens
        self.buffers = VerifyBuffers(self.max_rows, self.max_width, runner.device)
        self.wrappers = {}
        for kind in {spec.kind for spec in caches.state_layers}:
            self.wrappers[kind] = SpeculativeStateBackend(caches.backends[kind], self)
            caches.backends[kind] = self.wrappers[kind]
        # One scratch state per layer shape (its last row is the dump of padded positions), and
        # per layer the kept inputs of every position: [W, M, ...] each, allocated at first use.
        self._scratch: dict = {}
        for spec in caches.state_layers:
            shape = dataclasses.replace(spec, layer_idx=0)
            if shape not in self._scratch:
                self._scratch[shape] = self.wrappers[spec.kind].inner.allocate_state(self.max_rows, spec)
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._conv_weights: dict[int, torch.Tensor] = {}
        self._split: VerifySplit | None = None

    def scratch_of(self, layer):
        return self._scratch[dataclasses.replace(layer, layer_idx=0)]

    def kept_inputs(self, layer, conv_weight: torch.Tensor, *sources: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s buffers of the verified tokens' inputs (and its conv weight, for
        the commit). The first verify step (a warm-up dummy step on an accelerator, before the
        KV cache is sized) allocates them at their largest."""
        self._conv_weights[layer.layer_idx] = conv_weight
        kept = self._kept.get(layer.layer_idx)
        if kept is None:
            kept = tuple(torch.empty(self.max_width, self.max_rows, *source.shape[1:], dtype=source.dtype,
                                     device=source.device) for source in sources)
            self._kept[layer.layer_idx] = kept
        return kept

    def prepare(self, plan) -> None:
        """Before the forward (after the step's inputs are on the device): how this step's
        linear-attention layers run. A verify-width graph runs every row on the scratch state;
        an eager step with drafts runs its rows without drafts as usual and the others on the
        scratch."""
        split = None
        if plan.graph_size is not None and plan.graph_width > 1:
            batch = plan.batch
            self.buffers.batch_index[:batch].copy_(self.buffers.arange[:batch])
            split = VerifySplit(None, batch, plan.graph_width, plan.num_reqs)
        elif plan.has_drafts:
            split = self._eager_split(plan)
        self._split = split
        for wrapper in self.wrappers.values():
            wrapper.split = split

    def _eager_split(self, plan) -> VerifySplit:
        runner = self.runner
        device, pin = runner.device, runner.pin_memory
        num_reqs = plan.num_reqs
        starts = plan.query_start_loc[: num_reqs + 1].astype(np.int64)
        verifying = np.flatnonzero(plan.num_drafts > 0)
        plain = np.flatnonzero(plan.num_drafts == 0)
        plain_call = None
        if plain.size:
            lengths = starts[plain + 1] - starts[plain]
            token_index = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in plain])
            query_start_loc = np.zeros(plain.size + 1, dtype=np.int32)
            np.cumsum(lengths, out=query_start_loc[1:])
            state_indices = runner.inputs.state_indices[host_to_device(plain, device, pin)]
            metadata = LinearAttentionMetadata(
                query_start_loc=host_to_device(query_start_loc, device, pin), state_indices=state_indices,
                num_reqs=int(plain.size), num_tokens=int(token_index.size), max_query_len=int(lengths.max()),
                query_start_loc_cpu=torch.from_numpy(query_start_loc))
            plain_call = _Call(host_to_device(token_index, device, pin), metadata)
        runner.inputs.copy_from_host(self.buffers.batch_index, verifying)
        width = int(plan.num_drafts.max()) + 1
        return VerifySplit(plain_call, int(verifying.size), width, int(verifying.size))

    def position_metadata(self, wrapper: SpeculativeStateBackend, metadata: LinearAttentionMetadata,
                          split: VerifySplit) -> list:
        """The scratch rows' token, validity and slot at each position, from the step's
        ``query_start_loc`` and ``state_indices`` (device ops on fixed buffers), and each
        position's decode metadata over the scratch. Once per step and state kind."""
        buffers, rows = self.buffers, split.num_rows
        batch_index = buffers.batch_index[:rows]
        query_start_loc = metadata.query_start_loc.long()
        starts = query_start_loc[batch_index]  # [M]
        torch.sub(query_start_loc[batch_index + 1], starts, out=buffers.query_lens[:rows])
        lens = buffers.query_lens[:rows]
        buffers.slots[:rows].copy_(metadata.state_indices[batch_index])
        positions = []
        for j in range(split.width):
            valid = buffers.valid[j, :rows]
            torch.gt(lens, j, out=valid)
            torch.add(starts, (lens - 1).clamp(0, j), out=buffers.token_index[j, :rows])
            scratch_index = torch.where(valid, buffers.scratch_rows[:rows], buffers.scratch_rows[self.max_rows])
            positions.append(wrapper.inner.build_metadata(self._decode_metadata(scratch_index)))
        return positions

    def _decode_metadata(self, state_indices: torch.Tensor) -> LinearAttentionMetadata:
        rows = state_indices.shape[0]
        return LinearAttentionMetadata(
            query_start_loc=self.buffers.scratch_rows[: rows + 1], state_indices=state_indices, num_reqs=rows,
            num_tokens=rows, max_query_len=1, query_start_loc_cpu=self.buffers.scratch_rows_cpu[: rows + 1])

    def commit(self, num_rejected: torch.Tensor) -> None:
        """After rejection sampling (``num_rejected`` [num_reqs]: drafts each request rejected):
        each scratch row's slot runs the tokens its request keeps, from the kept inputs."""
        split = self._split
        self._split = None
        for wrapper in self.wrappers.values():
            wrapper.split = None
        if split is None or split.num_committed_rows == 0:
            return
        buffers, rows = self.buffers, split.num_committed_rows
        kept_tokens = buffers.query_lens[:rows] - num_rejected[buffers.batch_index[:rows]]  # [M]
        padding = torch.full_like(buffers.slots[:rows], self.runner.padding_state_slot)
        calls = {kind: [] for kind in self.wrappers}
        for j in range(split.width):
            state_indices = torch.where(kept_tokens > j, buffers.slots[:rows], padding).to(torch.int32)
            for kind, wrapper in self.wrappers.items():
                calls[kind].append(wrapper.inner.build_metadata(self._decode_metadata(state_indices)))
        caches = self.runner.caches
        for spec in caches.state_layers:
            inner = self.wrappers[spec.kind].inner
            kept = self._kept[spec.layer_idx]
            conv_weight = self._conv_weights[spec.layer_idx]
            state = caches.layer_states[spec.layer_idx]
            for j in range(split.width):
                inner.forward(spec, *(tensor[j, :rows] for tensor in kept), conv_weight, state, calls[spec.kind][j])
