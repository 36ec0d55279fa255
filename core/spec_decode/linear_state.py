"""Linear-attention layers (Gated DeltaNet, Kimi Delta Attention) under verification: no state for rejected drafts.

A verifying request feeds ``1 + k`` tokens through a layer whose state is one slot per request;
run as one chunk, the slot would end holding the state after every draft, rejected ones too.
So a verify step runs such layers position by position: the rows without drafts (prefill chunks,
plain decodes) in one call as usual, then, for ``j = 0..k``, the ``j``-th token of every
verifying request as one decode batch, keeping each verifying slot's state after every position
but the last. Once rejection sampling has said how many drafts each request accepted (``a``,
on the device), ``commit`` puts the state after ``1 + a`` tokens back into the slot (a request
that accepted every draft keeps what the last position left there).

Why a state per draft position and not a recompute: recomputing the accepted prefix needs the
layer inputs of every draft kept anyway, and a second pass of the recurrence per layer, with an
accepted count known on the device only (a masked pass of ``k + 1`` steps); the snapshots cost
``k`` copies of the verifying rows' states per layer for the step (allocated per step, freed at
commit) and no extra arithmetic. The ``k + 1`` decode calls run the backends' decode path, which
every linear-attention backend has, so any backend serves verification unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weir.buffers import host_to_device
from weir.linear_attention import LinearAttentionMetadata


@dataclass
class _Call:
    token_index: torch.Tensor  # [n] tokens of the step this call runs
    metadata: object  # the inner backend's metadata of the call


@dataclass
class VerifySplit:
    """One verify step's calls: the rows without drafts, then each draft position."""

    plain: _Call | None
    positions: list[_Call]
    verify_batch: torch.Tensor  # [M] batch index of each verifying request
    slots: torch.Tensor  # [M] int64 their state slots
    num_drafts: torch.Tensor  # [M] int64


@dataclass
class _StepMetadata:
    inner: object
    split: VerifySplit | None


class SpeculativeStateBackend:
    """Wraps one linear-attention backend instance; everything but a verify step's forward is
    the inner backend's own."""

    def __init__(self, inner):
        self.inner = inner
        self.split: VerifySplit | None = None  # set for each step by StateRollback.prepare
        # layer_idx -> (conv snapshots [K, M, ...], recurrent snapshots [K, M, ...]) until commit
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def build_metadata(self, metadata: LinearAttentionMetadata) -> _StepMetadata:
        split = self.split
        if split is not None:
            for call in ([split.plain] if split.plain is not None else []) + split.positions:
                call.metadata = self.inner.build_metadata(call.metadata)
        return _StepMetadata(self.inner.build_metadata(metadata), split)

    def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata: _StepMetadata):
        split = metadata.split
        if split is None:
            return self.inner.forward(layer, mixed_qkv, g, beta, conv_weight, state, metadata.inner)
        # Shaped after the first call's output: each layer kind has its own (Gated DeltaNet's
        # value heads, Kimi Delta Attention's heads), and the backend says which.
        out = None

        def run(call: _Call) -> None:
            nonlocal out
            index = call.token_index
            result = self.inner.forward(layer, mixed_qkv[index], g[index], beta[index], conv_weight, state,
                                        call.metadata)
            if out is None:
                out = result.new_zeros(mixed_qkv.shape[0], *result.shape[1:])
            out[index] = result

        if split.plain is not None:
            run(split.plain)
        conv_snapshots, recurrent_snapshots = [], []
        for position, call in enumerate(split.positions):
            run(call)
            if position < len(split.positions) - 1:  # the last position's state stays in the slot
                conv_snapshots.append(state.conv_state[split.slots])
                recurrent_snapshots.append(state.recurrent_state[split.slots])
        self.snapshots[layer.layer_idx] = (torch.stack(conv_snapshots), torch.stack(recurrent_snapshots))
        return out


class StateRollback:
    """Installs the wrappers on a runner's linear-attention backends and drives them per step."""

    def __init__(self, runner):
        self.runner = runner
        caches = runner.caches
        kinds = {spec.kind for spec in caches.state_layers}
        self.wrappers = {}
        for kind in kinds:
            self.wrappers[kind] = SpeculativeStateBackend(caches.backends[kind])
            caches.backends[kind] = self.wrappers[kind]

    def prepare(self, plan) -> None:
        """Before the forward (after the step's inputs are on the device): how this step's
        linear-attention layers run."""
        split = None
        if plan.has_drafts:
            split = self._split(plan)
        for wrapper in self.wrappers.values():
            wrapper.split = split
            wrapper.snapshots.clear()

    def _split(self, plan) -> VerifySplit:
        runner = self.runner
        device, pin = runner.device, runner.pin_memory
        num_reqs = plan.num_reqs
        starts = plan.query_start_loc[: num_reqs + 1].astype(np.int64)
        num_drafts = plan.num_drafts
        state_indices = runner.inputs.state_indices[: plan.batch]
        verifying = np.flatnonzero(num_drafts > 0)
        plain = np.flatnonzero(num_drafts == 0)
        plain_call = None
        if plain.size:
            lengths = starts[plain + 1] - starts[plain]
            token_index = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in plain])
            plain_call = self._call(token_index, plain, lengths, state_indices, device, pin)
        positions = []
        for j in range(int(num_drafts.max()) + 1):
            batch = verifying[num_drafts[verifying] >= j]
            positions.append(self._call(starts[batch] + j, batch, np.ones(batch.size, dtype=np.int64),
                                        state_indices, device, pin))
        verify_batch = host_to_device(verifying, device, pin)
        return VerifySplit(plain_call, positions, verify_batch, state_indices[verify_batch].long(),
                           host_to_device(num_drafts[verifying], device, pin))

    @staticmethod
    def _call(token_index: np.ndarray, batch: np.ndarray, lengths: np.ndarray, state_indices: torch.Tensor,
              device, pin) -> _Call:
        query_start_loc = np.zeros(batch.size + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start_loc[1:])
        batch_dev = host_to_device(batch.astype(np.int64), device, pin)
        metadata = LinearAttentionMetadata(
            query_start_loc=host_to_device(query_start_loc, device, pin), state_indices=state_indices[batch_dev],
            num_reqs=int(batch.size), num_tokens=int(token_index.size), max_query_len=int(lengths.max()),
            query_start_loc_cpu=torch.from_numpy(query_start_loc))
        return _Call(host_to_device(token_index.astype(np.int64), device, pin), metadata)

    def commit(self, num_accepted: torch.Tensor) -> None:
        """After rejection sampling: each verifying slot to its state after its accepted tokens."""
        caches = self.runner.caches
        for wrapper in self.wrappers.values():
            split = wrapper.split
            if split is None:
                continue
            accepted = num_accepted[split.verify_batch]  # [M]
            take = accepted < split.num_drafts  # a rejection: the slot holds states past it
            rows = torch.arange(accepted.shape[0], device=accepted.device)
            for layer_idx, (conv, recurrent) in wrapper.snapshots.items():
                state = caches.layer_states[layer_idx]
                at = accepted.clamp_max(conv.shape[0] - 1)
                for tensor, snapshots in ((state.conv_state, conv), (state.recurrent_state, recurrent)):
                    current = tensor[split.slots]
                    mask = take.view(-1, *([1] * (current.dim() - 1)))
                    tensor.index_copy_(0, split.slots, torch.where(mask, snapshots[at, rows], current))
            wrapper.snapshots.clear()
            wrapper.split = None
