"""The persistent request table: one row per running request, from admission to finish.

Token ids, progress counters and block-table rows (one table per paged cache group) live in device tensors indexed by row (the
sampler keeps each row's sampling parameters itself: ``weir.sample``). A step only stages
writes for new rows and new blocks; sampled tokens are written into ``token_ids`` on the
device, so decode needs no host round trip. Small host mirrors hold what the host must know
without reading the device (``num_computed_tokens``, which is exact without speculation, and
each row's block count).
"""

from __future__ import annotations

import numpy as np
import torch

from weir.buffers.staged_write import StagedWriteTensor
from weir.scheduler.output import NewRequestData


class RequestTable:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 device: torch.device, pin_memory: bool, num_block_groups: int = 1,
                 padding_state_slot: int | None = None):
        """One block table per paged cache group (``num_block_groups``); ``padding_state_slot``:
        hybrid models' spare state slot (rows hold their request's linear-attention slot, the
        padding row this one); None for models without such state."""
        self.max_num_reqs = max_num_reqs
        self.num_block_groups = num_block_groups
        self.device = device
        self.pin_memory = pin_memory
        # One spare row past the real ones pads CUDA-graph batches: never handed out, all zeros,
        # so its block table points at the null block only.
        self.padding_row = max_num_reqs
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}

        def staged(shape, dtype, fill=0):
            return StagedWriteTensor(shape, dtype, device, pin_memory, fill)

        R = max_num_reqs + 1
        self.token_ids = staged((R, max_model_len), torch.int32)
        self.num_tokens = staged((R,), torch.int32)  # known tokens, grown on the device by sampling
        self.num_computed_tokens = staged((R,), torch.int32)
        self.num_prompt_tokens = staged((R,), torch.int32)
        # Group g's table is rows g * R .. (g + 1) * R - 1: block_tables_view() is [G, R, max_blocks].
        self.block_tables = staged((num_block_groups * R, max_blocks_per_req), torch.int32)
        # Speculative decoding: drafts proposed for each row's next step, held in token_ids right
        # after its known tokens (an n-gram proposer may find fewer than it was asked for).
        self.num_drafts = staged((R,), torch.int32)
        self.padding_state_slot = padding_state_slot
        if padding_state_slot is not None:
            self.state_slot = staged((R,), torch.int32, padding_state_slot)
        self._staged = [v for v in vars(self).values() if isinstance(v, StagedWriteTensor)]

        # Host mirrors.
        self.num_computed_host = np.zeros(R, dtype=np.int64)
        # Bumped whenever a row is handed out, so a late correction of a mirror (rejected drafts,
        # known a step later) can tell that the row it names now holds another request.
        self.row_epoch = np.zeros(R, dtype=np.int64)
        self.num_blocks_host = np.zeros((num_block_groups, R), dtype=np.int64)  # blocks staged per group

    def add(self, new: NewRequestData) -> int:
        if not self.free_rows:
            raise RuntimeError(f"request table is full: more running requests than its {self.max_num_reqs} rows "
                               "(max_num_seqs, or a hybrid model's state slots)")
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        self.token_ids.stage(row, new.prefill_token_ids)
        self.num_tokens.stage(row, len(new.prefill_token_ids))
        self.num_computed_tokens.stage(row, new.num_computed_tokens)
        self.num_prompt_tokens.stage(row, new.num_prompt_tokens)
        self.num_drafts.stage(row, 0)
        self.row_epoch[row] += 1
        for group, block_ids in enumerate(new.block_ids):
            self.block_tables.stage(group * self.num_rows + row, block_ids)
            self.num_blocks_host[group, row] = len(block_ids)
        if self.padding_state_slot is not None:
            if new.state_slot is None:
                raise ValueError(f"request {new.req_id!r} has no linear-attention state slot")
            self.state_slot.stage(row, new.state_slot)
        self.num_computed_host[row] = new.num_computed_tokens
        return row

    def append_blocks(self, req_id: str, block_ids: tuple[list[int], ...]) -> None:
        """Append each group's new blocks to the request's row of that group's table."""
        row = self.row_of[req_id]
        for group, group_block_ids in enumerate(block_ids):
            if group_block_ids:
                self.block_tables.stage(group * self.num_rows + row, group_block_ids,
                                        start=int(self.num_blocks_host[group, row]))
                self.num_blocks_host[group, row] += len(group_block_ids)

    @property
    def num_rows(self) -> int:
        """Rows per table: one per schedulable request, plus the padding row."""
        return self.max_num_reqs + 1

    def block_tables_view(self) -> torch.Tensor:
        """Every group's persistent block table: [G, R, max_blocks_per_req] int32, device."""
        return self.block_tables.gpu.view(self.num_block_groups, self.num_rows, -1)

    def remove(self, req_id: str) -> int | None:
        """Free the request's row; returns it (None: the request held no row)."""
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)
        return row

    def apply_staged_writes(self) -> None:
        for tensor in self._staged:
            tensor.apply()
