"""The per-step sampling inputs: one row per sampled position, all on the device.

The runner fills these from its request table. The host flags (``all_greedy``, ``no_top_k``,
...) let the sampler skip work without reading device values, so sampling never synchronises.
``build_sampling_metadata`` builds one from host lists, for tests and simple callers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weir.buffers.staged_write import host_to_device
from weir.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Sampling parameters of every batch row, as device tensors plus host-side skip flags.

    Contract with the sampler: greedy rows carry temperature 0; ``all_greedy`` / ``all_random``
    say that every row / no row is greedy (temperature 0 or top_k 1). ``positions[i]`` is the
    number of tokens before the token being sampled; with ``seeds[i]`` it keys the noise.
    """

    temperature: torch.Tensor  # [num_rows] fp32, 0 = greedy
    top_k: torch.Tensor  # [num_rows] int32, 0 = off
    top_p: torch.Tensor  # [num_rows] fp32, 1 = off
    min_p: torch.Tensor  # [num_rows] fp32, 0 = off
    seeds: torch.Tensor  # [num_rows] int64; unseeded requests get one from the engine RNG
    positions: torch.Tensor  # [num_rows] int64
    presence_penalty: torch.Tensor  # [num_rows] fp32
    frequency_penalty: torch.Tensor  # [num_rows] fp32
    repetition_penalty: torch.Tensor  # [num_rows] fp32
    # Both None when no row uses penalties, so the common case pays nothing.
    output_token_counts: torch.Tensor | None  # [num_rows, vocab] int32
    prompt_token_mask: torch.Tensor | None  # [num_rows, vocab] bool
    # (row_idx [num_banned] int64, token_id [num_banned] int64): forced to -inf before sampling.
    banned_token_ids: tuple[torch.Tensor, torch.Tensor] | None
    # None: no logprobs at all; k >= 0: the sampled token's logprob plus the top k.
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def _to_device(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Pinned on CUDA, so the copy runs asynchronously instead of blocking the host.
    return host_to_device(torch.as_tensor(values, dtype=dtype).numpy(), device, pin_memory=device.type == "cuda")


def _flat_token_indices(rows: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """``row * vocab_size + token_id`` for every token of every row, as int64."""
    lengths = [len(ids) for ids in rows]
    row_of_token = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    token_ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=sum(lengths))
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got {token_ids.min()}..{token_ids.max()}")
    return row_of_token * vocab_size + token_ids


def _as_int64(seed: int) -> int:
    """Wrap any Python int seed into the signed 64-bit range the seeds tensor holds."""
    return (seed + 2**63) % 2**64 - 2**63


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    vocab_size: int,
    device: torch.device | str = "cpu",
    output_token_ids: Sequence[Sequence[int]] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> SamplingMetadata:
    """Build the metadata of ``len(params)`` rows from host data.

    ``seeds`` must already hold a seed for every row (the request's, or one drawn for it).
    Rows that have generated fewer than ``min_tokens`` tokens get their stop token ids (and EOS
    unless ``ignore_eos``) banned.
    """
    device = torch.device(device)
    num_rows = len(params)
    if len(seeds) != num_rows or len(positions) != num_rows:
        raise ValueError(
            f"seeds ({len(seeds)}) and positions ({len(positions)}) need one entry per row ({num_rows})"
        )
    outputs = output_token_ids if output_token_ids is not None else [[] for _ in range(num_rows)]
    prompts = prompt_token_ids if prompt_token_ids is not None else [[] for _ in range(num_rows)]
    greedy = [p.is_greedy for p in params]
    # Greedy rows ignore the filters, so zero them to keep the skip flags honest.
    top_k = [0 if g else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]  # fits int32
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    no_penalties = not any(p.uses_penalties for p in params)

    output_token_counts = prompt_token_mask = None
    if not no_penalties:
        # Built on the device from flat (row * vocab + id) indices: a dense [rows, vocab] host
        # array to pin and copy took most of a second at 1024 rows.
        counts = torch.zeros(num_rows * vocab_size, dtype=torch.int32, device=device)
        output_flat = _flat_token_indices(outputs, vocab_size)
        counts.index_add_(0, _to_device(output_flat, torch.int64, device),
                          torch.ones(len(output_flat), dtype=torch.int32, device=device))
        mask = torch.zeros(num_rows * vocab_size, dtype=torch.bool, device=device)
        mask[_to_device(_flat_token_indices(prompts, vocab_size), torch.int64, device)] = True
        output_token_counts = counts.view(num_rows, vocab_size)  # [num_rows, vocab]
        prompt_token_mask = mask.view(num_rows, vocab_size)  # [num_rows, vocab]

    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for row, (p, output_ids) in enumerate(zip(params, outputs)):
        if len(output_ids) < p.min_tokens:
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned_rows += [row] * len(stop_ids)
            banned_tokens += sorted(stop_ids)
    banned = None
    if banned_rows:
        banned = (
            _to_device(banned_rows, torch.int64, device),
            _to_device(banned_tokens, torch.int64, device),
        )

    requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    temperature = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
    return SamplingMetadata(
        temperature=_to_device(temperature, torch.float32, device),
        top_k=_to_device(top_k, torch.int32, device),
        top_p=_to_device(top_p, torch.float32, device),
        min_p=_to_device(min_p, torch.float32, device),
        seeds=_to_device([_as_int64(s) for s in seeds], torch.int64, device),
        positions=_to_device(list(positions), torch.int64, device),
        presence_penalty=_to_device([p.presence_penalty for p in params], torch.float32, device),
        frequency_penalty=_to_device([p.frequency_penalty for p in params], torch.float32, device),
        repetition_penalty=_to_device([p.repetition_penalty for p in params], torch.float32, device),
        output_token_counts=output_token_counts,
        prompt_token_mask=prompt_token_mask,
        banned_token_ids=banned,
        max_num_logprobs=max(requested_logprobs) if requested_logprobs else None,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        no_top_k=all(k == 0 for k in top_k),
        no_top_p=all(p == 1.0 for p in top_p),
        no_min_p=all(p == 0.0 for p in min_p),
        no_penalties=no_penalties,
    )
