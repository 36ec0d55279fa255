"""A draft network's paged layers, riding in the target's cache groups.

A draft (a draft model, an EAGLE head, an MTP block) computes the KV of the same positions as
the target, so its layers share the target's blocks: each draft layer joins the target's cache
group of the same sliding window and is indexed by that group's block table and slot mapping.
A block then holds the target's and the draft's entries for its tokens (the KV sizing counts the
draft's bytes per block into the group), prefix-cache hits serve both, and freeing, preemption
and window freeing need nothing more. Drafts with linear-attention state are refused: their
state would have to follow acceptance too.
"""

from __future__ import annotations

import numpy as np
import torch

from weir.attention import AttentionMetadata
from weir.buffers import host_to_device
from weir.layer_cache import ForwardContext
from weir.runner.inputs import gather_block_tables_and_slot_mapping
from weir.runner.layer_caches import LayerCaches


class DraftCaches:
    def __init__(self, runner, model: torch.nn.Module, what: str):
        config = runner.config
        self.runner = runner
        self.caches = LayerCaches(model, runner.choose_attention_backends, runner.block_size, runner.dtype,
                                  runner.device, config.cache.linear_state_dtype)
        if self.caches.state_layers:
            raise ValueError(f"{what} has linear-attention layers, which a draft cannot have (their state would "
                             f"have to follow each step's acceptance): choose a draft with attention layers only")
        target_windows = [group.sliding_window for group in runner.caches.groups]
        self.group_map = []
        for group in self.caches.groups:
            if group.sliding_window not in target_windows:
                window = group.sliding_window
                kind = "full attention" if window is None else f"a sliding window of {window}"
                raise ValueError(f"{what} has layers with {kind}, which no cache group of the target has: a draft's "
                                 f"layers must share the target's cache groups")
            self.group_map.append(target_windows.index(group.sliding_window))

    def extra_bytes_per_block(self, target_group: int) -> int:
        return sum(self.caches.bytes_per_block(group) for group, g in zip(self.caches.groups, self.group_map)
                   if g == target_group)

    def allocate(self, num_blocks: list[int]) -> None:
        """``num_blocks`` per target group, as the target's caches got them."""
        self.caches.allocate_kv_caches([num_blocks[g] for g in self.group_map])

    def context(self, rows: torch.Tensor, query_start_loc: np.ndarray, positions: torch.Tensor,
                seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int) -> ForwardContext:
        """A forward over ``rows`` (table rows, device) with these tokens: ``positions [T]``
        (unclamped: slots past a request's blocks come out -1), ``seq_lens [n]``."""
        runner = self.runner
        qsl = host_to_device(query_start_loc.astype(np.int32), runner.device, runner.pin_memory)
        return self.device_context(rows, qsl, positions, seq_lens, max_query_len, max_seq_len,
                                   has_unowned_tokens=positions.shape[0] > int(query_start_loc[-1]))

    def device_context(self, rows: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                       seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int,
                       has_unowned_tokens: bool) -> ForwardContext:
        """``context`` with ``query_start_loc [n + 1]`` (int32) already on the device: what a
        captured pass reads (``weir.spec_decode.proposal_graphs``)."""
        runner = self.runner
        max_seq_len = min(max_seq_len, runner.max_model_len)
        tables, slots = gather_block_tables_and_slot_mapping(runner.table.block_tables_view(), rows, query_start_loc,
                                                             positions, runner.block_size)
        metadata = []
        for g in self.group_map:
            metadata.append(AttentionMetadata(
                query_start_loc=query_start_loc, seq_lens=seq_lens.clamp_max(runner.max_model_len).int(),
                block_tables=tables[g], slot_mapping=slots[g], num_reqs=rows.shape[0], num_tokens=positions.shape[0],
                max_query_len=max_query_len, max_seq_len=max_seq_len, has_unowned_tokens=has_unowned_tokens))
        return self.caches.forward_context(metadata, None, runner.moe_backend)


def step_starts(runner, plan) -> torch.Tensor:
    """Each request's first position in this step, [num_reqs] int64 on the device."""
    firsts = host_to_device(plan.query_start_loc[: plan.num_reqs].astype(np.int64), runner.device, runner.pin_memory)
    return runner.inputs.positions[firsts].long()
