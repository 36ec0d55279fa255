"""The persistent request table: one row per running request, from admission to finish.

Token ids, progress counters, block-table rows and sampling parameters live in device tensors
indexed by row. A step only stages writes for new rows and new blocks; sampled tokens are
written into ``token_ids`` on the device, so decode needs no host round trip. Small host
mirrors hold what the host must know without reading the device (row parameters for the
sampler's fast-path flags, and ``num_computed_tokens``, which is exact without speculation).
"""

from __future__ import annotations

import numpy as np
import torch

from weir.buffers.staged_write import StagedWriteTensor, host_to_device
from weir.scheduler.output import NewRequestData


class RequestTable:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int,
                 device: torch.device, pin_memory: bool, padding_state_slot: int | None = None):
        """``padding_state_slot``: hybrid models' spare state slot (rows hold their request's
        linear-attention slot, the padding row this one); None for models without such state."""
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
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
        self.block_table = staged((R, max_blocks_per_req), torch.int32)
        self.temperature = staged((R,), torch.float32)
        self.top_k = staged((R,), torch.int32)
        self.top_p = staged((R,), torch.float32, 1.0)
        self.min_p = staged((R,), torch.float32)
        self.seeds = staged((R,), torch.int64)
        self.presence_penalty = staged((R,), torch.float32)
        self.frequency_penalty = staged((R,), torch.float32)
        self.repetition_penalty = staged((R,), torch.float32, 1.0)
        self.padding_state_slot = padding_state_slot
        if padding_state_slot is not None:
            self.state_slot = staged((R,), torch.int32, padding_state_slot)
        self._staged = [v for v in vars(self).values() if isinstance(v, StagedWriteTensor)]

        # Penalty state is [rows, vocab]: allocated only once a request uses penalties.
        self.output_token_counts: torch.Tensor | None = None  # [R, V] int32
        self.prompt_token_mask: torch.Tensor | None = None  # [R, V] bool

        # Host mirrors.
        self.num_computed_host = np.zeros(R, dtype=np.int64)
        self.num_blocks_host = np.zeros(R, dtype=np.int64)
        self.temperature_host = np.zeros(R, dtype=np.float32)
        self.top_k_host = np.zeros(R, dtype=np.int64)
        self.top_p_host = np.ones(R, dtype=np.float32)
        self.min_p_host = np.zeros(R, dtype=np.float32)
        self.uses_penalties_host = np.zeros(R, dtype=bool)
        self.num_logprobs_host = np.full(R, -1, dtype=np.int64)  # -1: none requested
        self.stop_token_ids: list[tuple[int, ...]] = [()] * R

    def add(self, new: NewRequestData) -> int:
        if not self.free_rows:
            raise RuntimeError("request table is full: more running requests than max_num_seqs")
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        params = new.sampling_params
        self.token_ids.stage(row, new.prefill_token_ids)
        self.num_tokens.stage(row, len(new.prefill_token_ids))
        self.num_computed_tokens.stage(row, new.num_computed_tokens)
        self.num_prompt_tokens.stage(row, new.num_prompt_tokens)
        self.block_table.stage(row, new.block_ids)
        if self.padding_state_slot is not None:
            if new.state_slot is None:
                raise ValueError(f"request {new.req_id!r} has no linear-attention state slot")
            self.state_slot.stage(row, new.state_slot)
        self.num_computed_host[row] = new.num_computed_tokens
        self.num_blocks_host[row] = len(new.block_ids)
        # The sampler's contract: greedy rows (temperature 0 or top_k 1) carry temperature 0.
        temperature = 0.0 if params.is_greedy else params.temperature
        self.temperature.stage(row, temperature)
        # Any int is a valid seed or top_k; the device holds them as int64 / int32.
        self.top_k.stage(row, min(params.top_k, self.vocab_size))
        self.top_p.stage(row, params.top_p)
        self.min_p.stage(row, params.min_p)
        self.seeds.stage(row, (new.seed + 2**63) % 2**64 - 2**63)
        self.presence_penalty.stage(row, params.presence_penalty)
        self.frequency_penalty.stage(row, params.frequency_penalty)
        self.repetition_penalty.stage(row, params.repetition_penalty)
        self.temperature_host[row] = temperature
        self.top_k_host[row] = min(params.top_k, self.vocab_size)
        self.top_p_host[row] = params.top_p
        self.min_p_host[row] = params.min_p
        self.num_logprobs_host[row] = -1 if params.logprobs is None else params.logprobs
        self.stop_token_ids[row] = new.stop_token_ids
        uses_penalties = (params.presence_penalty != 0 or params.frequency_penalty != 0
                          or params.repetition_penalty != 1)
        self.uses_penalties_host[row] = uses_penalties
        if uses_penalties:
            self._init_penalty_state(row, new)
        return row

    def _init_penalty_state(self, row: int, new: NewRequestData) -> None:
        if self.output_token_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_token_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        token_ids = np.asarray(new.prefill_token_ids, dtype=np.int64)
        prompt_ids = host_to_device(token_ids[: new.num_prompt_tokens], self.device, self.pin_memory)
        output_ids = host_to_device(token_ids[new.num_prompt_tokens:], self.device, self.pin_memory)
        self.prompt_token_mask[row].zero_().index_fill_(0, prompt_ids, True)
        counts = self.output_token_counts[row].zero_()
        counts.index_add_(0, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[req_id]
        self.block_table.stage(row, block_ids, start=int(self.num_blocks_host[row]))
        self.num_blocks_host[row] += len(block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.uses_penalties_host[row] = False
            self.free_rows.append(row)

    def apply_staged_writes(self) -> None:
        for tensor in self._staged:
            tensor.apply()
