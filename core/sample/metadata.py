"""One step's view of the sampler's rows: which row each batch row is, plus host skip flags.

The per-row parameters stay in the sampler's own tensors (``weir.sample.states``, written at
admission); a ``SamplingMetadata`` points at them and carries ``idx_mapping`` (batch row ->
sampler row), so the Triton kernels read each batch row's parameters through it and no
parameter is copied per step. The torch ops, the oracle, work on batch-ordered tensors: they
take ``gathered()``. The host flags (``all_greedy``, ``no_top_k``, ...) let the sampler skip
work without reading device values, so sampling never synchronises.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """Contract with the sampler: greedy rows carry temperature 0 (and no filters);
    ``all_greedy`` / ``all_random`` say that every / no batch row is greedy (temperature 0 or
    top_k 1). ``positions[i]`` is the number of tokens before the token batch row ``i``
    samples; with its row's seed it keys the noise.

    Per-row tensors are indexed by sampler row (``idx_mapping[i]`` for batch row ``i``);
    ``gathered()`` returns the same metadata in batch order, with ``idx_mapping`` the identity.
    """

    idx_mapping: torch.Tensor  # [B] int64: the sampler row of each batch row
    positions: torch.Tensor  # [B] int32 or int64
    temperature: torch.Tensor  # [R] fp32, 0 = greedy
    top_k: torch.Tensor  # [R] int32, 0 = off
    top_p: torch.Tensor  # [R] fp32, 1 = off
    min_p: torch.Tensor  # [R] fp32, 0 = off
    log_min_p: torch.Tensor  # [R] fp32, log(min_p) as torch rounds it on this device
    seeds: torch.Tensor  # [R] int64; unseeded requests got one from the engine RNG
    presence_penalty: torch.Tensor  # [R] fp32
    frequency_penalty: torch.Tensor  # [R] fp32
    repetition_penalty: torch.Tensor  # [R] fp32
    # Both None when no batch row uses penalties: such a batch reads neither.
    output_token_counts: torch.Tensor | None  # [R, vocab] int32
    prompt_token_mask: torch.Tensor | None  # [R, vocab] bool
    # (batch_idx [num_banned] int64, token_id [num_banned] int64): forced to -inf before sampling.
    banned_token_ids: tuple[torch.Tensor, torch.Tensor] | None
    # None: no logprobs at all; k >= 0: the sampled token's logprob plus the top k.
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool
    in_batch_order: bool = False  # True: per-row tensors are [B] already (what gathered() returns)
    _gathered: SamplingMetadata | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return self.idx_mapping.shape[0]

    def gathered(self) -> SamplingMetadata:
        """This metadata with every per-row tensor gathered into batch order (``[B]``, ``[B, V]``)
        and ``positions`` as int64: what the torch ops take. Computed once per metadata."""
        if self.in_batch_order:
            return self
        if self._gathered is None:
            idx = self.idx_mapping

            def rows_of(values: torch.Tensor | None) -> torch.Tensor | None:
                return None if values is None else values[idx]

            self._gathered = dataclasses.replace(
                self,
                idx_mapping=torch.arange(self.num_rows, device=idx.device),
                positions=self.positions.long(),
                in_batch_order=True,
                **{name: rows_of(getattr(self, name)) for name in (
                    "temperature", "top_k", "top_p", "min_p", "log_min_p", "seeds", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "output_token_counts", "prompt_token_mask")},
            )
        return self._gathered
