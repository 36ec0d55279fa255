"""The sampler's per-row state: each running request's sampling parameters, from admission on.

Rows are the runner's request-table rows. ``add_request`` stages a row's parameters (one
``StagedWriteTensor`` per parameter, applied by ``apply_staged_writes`` once per step) and sets
the small host mirrors that decide the per-step skip flags without reading the device.
Penalty state (``[rows, vocab]`` output-token counts and prompt-token mask) is allocated when
the first request with penalties arrives: on accelerators that is the start-up warm-up, whose
sampling kinds include penalties, so the memory is taken (and counted) before the KV cache is
sized and no request allocates it later. A row's state is reset when a request takes it, and the
runner's post-update kernel adds each sampled token to ``output_token_counts``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from weir.buffers import StagedWriteTensor, host_to_device
from weir.sample.metadata import SamplingMetadata
from weir.sampling_params import SamplingParams


def as_int64_seed(seed: int) -> int:
    """Wrap any Python int seed into the signed 64-bit range the seeds tensor holds."""
    return (seed + 2**63) % 2**64 - 2**63


def _token_array(token_ids: Sequence[int], vocab_size: int, what: str) -> np.ndarray:
    array = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise ValueError(f"{what} must lie in [0, {vocab_size}), got {array.min()}..{array.max()}")
    return array


class SamplingStates:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str, pin_memory: bool):
        if max_num_reqs < 1 or vocab_size < 1:
            raise ValueError(f"max_num_reqs ({max_num_reqs}) and vocab_size ({vocab_size}) must be positive")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.pin_memory = pin_memory

        # Row max_num_reqs is the spare padding row: off (greedy, no filters), never sampled.
        num_rows = max_num_reqs + 1

        def staged(dtype, fill=0):
            return StagedWriteTensor((num_rows,), dtype, self.device, pin_memory, fill)

        self.temperature = staged(torch.float32)
        self.top_k = staged(torch.int32)
        self.top_p = staged(torch.float32, 1.0)
        self.min_p = staged(torch.float32)
        self.seeds = staged(torch.int64)
        self.presence_penalty = staged(torch.float32)
        self.frequency_penalty = staged(torch.float32)
        self.repetition_penalty = staged(torch.float32, 1.0)
        self._staged = [v for v in vars(self).values() if isinstance(v, StagedWriteTensor)]
        # log(min_p) by torch on this device, so the Triton threshold rounds as ops.apply_min_p's.
        self.log_min_p = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=self.device)

        # Allocated with the first request that uses penalties; only real rows have a row here.
        self.output_token_counts: torch.Tensor | None = None  # [max_num_reqs, V] int32
        self.prompt_token_mask: torch.Tensor | None = None  # [max_num_reqs, V] bool

        # Host mirrors: what the per-step flags need, never read back from the device.
        self.active = np.zeros(num_rows, dtype=bool)
        self.temperature_host = np.zeros(num_rows, dtype=np.float32)
        self.top_k_host = np.zeros(num_rows, dtype=np.int64)
        self.top_p_host = np.ones(num_rows, dtype=np.float32)
        self.min_p_host = np.zeros(num_rows, dtype=np.float32)
        self.uses_penalties_host = np.zeros(num_rows, dtype=bool)
        self.num_logprobs_host = np.full(num_rows, -1, dtype=np.int64)  # -1: none requested
        self.min_tokens_host = np.zeros(num_rows, dtype=np.int64)  # speculative steps ban on the device
        self.stop_token_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_rows
        # Rows written since the last apply (two staged writes to one element would race).
        self._staged_rows: set[int] = set()
        # Rows whose penalty state is reset at the next apply: (prompt ids, output ids).
        self._penalty_inits: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"sampler row {row} is outside [0, {self.max_num_reqs})")

    def add_request(self, row: int, params: SamplingParams, seed: int, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int], stop_token_ids: Sequence[int]) -> None:
        """Stage ``row``'s parameters; ``stop_token_ids`` (EOS included unless ignored) are banned
        in the steps whose ``min_tokens`` lists this row's batch index."""
        self._check_row(row)
        if self.active[row]:
            raise ValueError(f"sampler row {row} already holds a request: remove_request({row}) first")
        if row in self._staged_rows:
            raise ValueError(f"sampler row {row} was written since the last apply_staged_writes(); apply first")
        stop_ids = np.unique(_token_array(stop_token_ids, self.vocab_size, "stop token ids"))
        greedy = params.is_greedy
        # The metadata's contract: greedy rows carry temperature 0 and no filters.
        temperature = 0.0 if greedy else params.temperature
        top_k = 0 if greedy else min(params.top_k, self.vocab_size)  # any int is a valid top_k: fits int32
        top_p = 1.0 if greedy else params.top_p
        min_p = 0.0 if greedy else params.min_p
        if params.uses_penalties:
            self._penalty_inits[row] = (_token_array(prompt_token_ids, self.vocab_size, "prompt token ids"),
                                        _token_array(output_token_ids, self.vocab_size, "output token ids"))
        for tensor, value in ((self.temperature, temperature), (self.top_k, top_k), (self.top_p, top_p),
                              (self.min_p, min_p), (self.seeds, as_int64_seed(seed)),
                              (self.presence_penalty, params.presence_penalty),
                              (self.frequency_penalty, params.frequency_penalty),
                              (self.repetition_penalty, params.repetition_penalty)):
            tensor.stage(row, value)
        self._staged_rows.add(row)
        self.active[row] = True
        self.temperature_host[row] = temperature
        self.top_k_host[row] = top_k
        self.top_p_host[row] = top_p
        self.min_p_host[row] = min_p
        self.uses_penalties_host[row] = params.uses_penalties
        self.num_logprobs_host[row] = -1 if params.logprobs is None else params.logprobs
        self.min_tokens_host[row] = params.min_tokens
        self.stop_token_ids[row] = stop_ids

    def remove_request(self, row: int) -> None:
        """Free ``row``; its device values stay until the next request overwrites them."""
        self._check_row(row)
        self.active[row] = False
        self.uses_penalties_host[row] = False
        self._penalty_inits.pop(row, None)  # a row added and removed before an apply

    def apply_staged_writes(self) -> None:
        """Copy this step's staged rows to the device: once per step, before sampling."""
        for tensor in self._staged:
            tensor.apply()
        if self._staged_rows:
            torch.log(self.min_p.gpu, out=self.log_min_p)  # [R]
            self._staged_rows.clear()
        if self._penalty_inits:
            self._reset_penalty_rows()

    def _reset_penalty_rows(self) -> None:
        """Zero the new rows' penalty state, then mark their prompt tokens and count their
        outputs (a resumed request recomputes them), all rows in one op each."""
        vocab_size = self.vocab_size
        if self.output_token_counts is None:
            shape = (self.max_num_reqs, vocab_size)
            self.output_token_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        rows = np.fromiter(self._penalty_inits, dtype=np.int64, count=len(self._penalty_inits))
        prompts, outputs = zip(*self._penalty_inits.values())
        self._penalty_inits.clear()

        def flat(token_lists) -> torch.Tensor:  # row * vocab + token id, [num_tokens] int64
            offsets = np.repeat(rows * vocab_size, [len(ids) for ids in token_lists])
            return host_to_device(offsets + np.concatenate(token_lists), self.device, self.pin_memory)

        rows_device = host_to_device(rows, self.device, self.pin_memory)
        self.output_token_counts.index_fill_(0, rows_device, 0)
        self.prompt_token_mask.index_fill_(0, rows_device, False)
        self.prompt_token_mask.view(-1).index_fill_(0, flat(prompts), True)
        output_flat = flat(outputs)
        counts = self.output_token_counts.view(-1)
        counts.index_add_(0, output_flat, torch.ones_like(output_flat, dtype=counts.dtype))

    def batch_metadata(self, idx_mapping: torch.Tensor, rows: np.ndarray, positions: torch.Tensor,
                       min_tokens: Sequence[int] = ()) -> SamplingMetadata:
        """The metadata of one step's batch: batch row ``i`` is sampler row ``rows[i]`` (host) =
        ``idx_mapping[i]`` (device), and ``min_tokens`` lists the batch rows whose stop tokens
        are banned this step."""
        rows = np.asarray(rows, dtype=np.int64)
        num_rows = rows.shape[0]
        if num_rows == 0:
            raise ValueError("a sampling batch needs at least one row")
        if idx_mapping.shape != (num_rows,) or positions.shape != (num_rows,):
            raise ValueError(f"idx_mapping {tuple(idx_mapping.shape)} and positions {tuple(positions.shape)} "
                             f"need one entry per batch row ({num_rows})")
        if rows.min() < 0 or rows.max() >= self.max_num_reqs or not self.active[rows].all():
            bad = [int(r) for r in rows if not (0 <= r < self.max_num_reqs and self.active[r])]
            raise ValueError(f"sampler rows {bad} hold no request (add_request first)")
        temperature = self.temperature_host[rows]
        greedy = temperature == 0
        random_rows = rows[~greedy]
        uses_penalties = bool(self.uses_penalties_host[rows].any())
        num_logprobs = int(self.num_logprobs_host[rows].max())
        return SamplingMetadata(
            idx_mapping=idx_mapping, positions=positions,
            temperature=self.temperature.gpu, top_k=self.top_k.gpu, top_p=self.top_p.gpu, min_p=self.min_p.gpu,
            log_min_p=self.log_min_p, seeds=self.seeds.gpu, presence_penalty=self.presence_penalty.gpu,
            frequency_penalty=self.frequency_penalty.gpu, repetition_penalty=self.repetition_penalty.gpu,
            output_token_counts=self.output_token_counts if uses_penalties else None,
            prompt_token_mask=self.prompt_token_mask if uses_penalties else None,
            banned_token_ids=self._banned_token_ids(rows, min_tokens),
            max_num_logprobs=None if num_logprobs < 0 else num_logprobs,
            all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
            no_top_k=bool((self.top_k_host[random_rows] == 0).all()),
            no_top_p=bool((self.top_p_host[random_rows] == 1).all()),
            no_min_p=bool((self.min_p_host[random_rows] == 0).all()),
            no_penalties=not uses_penalties,
        )

    def _banned_token_ids(self, rows: np.ndarray, min_tokens: Sequence[int]):
        if len(min_tokens) == 0:
            return None
        batch_idx = np.asarray(min_tokens, dtype=np.int64)
        if batch_idx.min() < 0 or batch_idx.max() >= len(rows):
            raise ValueError(f"min_tokens batch rows must lie in [0, {len(rows)}), got {batch_idx.tolist()}")
        stop_ids = [self.stop_token_ids[row] for row in rows[batch_idx]]
        token_ids = np.concatenate(stop_ids)
        if token_ids.size == 0:
            return None
        banned_rows = np.repeat(batch_idx, [len(ids) for ids in stop_ids])
        return (host_to_device(banned_rows, self.device, self.pin_memory),
                host_to_device(token_ids, self.device, self.pin_memory))
