"""The sampler: logits of one step -> sampled token ids (and logprobs), all on the device.

The sampler owns each running request's sampling parameters (``weir.sample.states``): the
runner calls ``add_request`` at admission, ``remove_request`` when a request leaves,
``apply_staged_writes`` once per step and ``sample`` with the batch's ``idx_mapping``; the
kernels read each batch row's parameters through it.

Order, as vLLM: logprobs of the raw logits (before any processing); banned tokens; penalties;
then greedy rows take the argmax and random rows go through temperature, min-p, top-k/top-p
and Gumbel-max with noise keyed on (seed, position, token). Greedy and random rows are merged
with ``torch.where``; only host flags decide which work runs, so nothing here waits on the device.
On CUDA the penalties and the token choice run as Triton kernels (``WEIR_DISABLE_TRITON=1``
forces the torch ops, which stay the reference and the path on every other device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weir.kernels.dispatch import triton_module, use_triton
from weir.sample import ops
from weir.sample.metadata import SamplingMetadata
from weir.sample.states import SamplingStates
from weir.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    """One step's samples; every tensor stays on the device until the runner copies it."""

    sampled_token_ids: torch.Tensor  # [num_rows] int64
    # Column 0 is the sampled token, columns 1..k the k most likely under the raw logits.
    logprob_token_ids: torch.Tensor | None  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor | None  # [num_rows, 1 + k] fp32
    sampled_token_ranks: torch.Tensor | None  # [num_rows] int64, 1 = the most likely token


class Sampler:
    """Samples from rows ``0 .. max_num_reqs - 1`` (the runner's request-table rows), each
    holding one request's parameters from ``add_request`` to ``remove_request``."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str, pin_memory: bool):
        self.states = SamplingStates(max_num_reqs, vocab_size, device, pin_memory)

    @classmethod
    def for_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int], vocab_size: int,
                   device: torch.device | str = "cpu", prompt_token_ids: Sequence[Sequence[int]] | None = None,
                   output_token_ids: Sequence[Sequence[int]] | None = None,
                   eos_token_ids: Sequence[int] = ()) -> Sampler:
        """A sampler whose row ``i`` holds ``params[i]`` with seed ``seeds[i]``, written and
        applied as the runner does: for tests, benchmarks and warm-up. Each row's stop tokens
        are its ``stop_token_ids`` plus ``eos_token_ids`` unless it ignores EOS."""
        num_rows = len(params)
        empty = [[] for _ in range(num_rows)]
        prompts = prompt_token_ids if prompt_token_ids is not None else empty
        outputs = output_token_ids if output_token_ids is not None else empty
        if not len(seeds) == len(prompts) == len(outputs) == num_rows:
            raise ValueError(f"seeds ({len(seeds)}), prompt_token_ids ({len(prompts)}) and output_token_ids "
                             f"({len(outputs)}) need one entry per row ({num_rows})")
        device = torch.device(device)
        sampler = cls(max(num_rows, 1), vocab_size, device, pin_memory=device.type == "cuda")
        for row, (p, seed, prompt, output) in enumerate(zip(params, seeds, prompts, outputs)):
            stop_ids = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
            sampler.add_request(row, p, seed, prompt, output, stop_ids)
        sampler.apply_staged_writes()
        return sampler

    def add_request(self, row: int, params: SamplingParams, seed: int, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int], stop_token_ids: Sequence[int]) -> None:
        """Stage ``row``'s parameters (applied by ``apply_staged_writes``). ``output_token_ids``
        are the outputs so far (a resumed request's), counted by the penalties."""
        self.states.add_request(row, params, seed, prompt_token_ids, output_token_ids, stop_token_ids)

    def remove_request(self, row: int) -> None:
        self.states.remove_request(row)

    def apply_staged_writes(self) -> None:
        """Once per step, after the step's add_request calls and before ``sample``."""
        self.states.apply_staged_writes()

    @property
    def output_token_counts(self) -> torch.Tensor | None:
        """``[max_num_reqs, vocab]`` int32 counts of each row's output tokens, None until a request
        uses penalties. The runner's post-update adds every sampled token to its row here."""
        return self.states.output_token_counts

    def batch_metadata(self, idx_mapping: torch.Tensor, rows: np.ndarray, positions: torch.Tensor,
                       min_tokens: Sequence[int] = ()) -> SamplingMetadata:
        """See ``sample``."""
        return self.states.batch_metadata(idx_mapping, rows, positions, min_tokens)

    def sample(self, logits: torch.Tensor, idx_mapping: torch.Tensor, rows: np.ndarray, positions: torch.Tensor,
               min_tokens: Sequence[int] = ()) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([B, vocab], fp32 or the model's dtype; not
        modified). Batch row ``i`` samples with sampler row ``idx_mapping[i]`` ([B] int64 on the
        device; ``rows`` [B] is the same on the host), after ``positions[i]`` tokens; the
        batch rows listed in ``min_tokens`` have their stop tokens banned."""
        return self.sample_batch(logits, self.batch_metadata(idx_mapping, rows, positions, min_tokens))

    def sample_batch(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``sample`` for a metadata already built (``batch_metadata``)."""
        if logits.shape[0] != metadata.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, the metadata {metadata.num_rows}")
        fused_path = (use_triton(logits) and metadata.no_penalties and metadata.banned_token_ids is None
                      and metadata.max_num_logprobs is None)
        # torch ops, penalties and logprobs work in fp32 (the kernels upcast in registers): a row's
        # penalised logits must not depend on whether its batch-mates are all greedy.
        if logits.dtype != torch.float32 and not (fused_path or (metadata.all_greedy and metadata.no_penalties)):
            logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            # fp32 whatever the batch: an all-greedy batch keeps the model's dtype above, and a
            # request's logprobs must not depend on its batch-mates.
            raw_logprobs = logits.float().log_softmax(dim=-1)  # [num_rows, vocab]
        logits = self.apply_constraints(logits, metadata)
        sampled_token_ids = self.choose_tokens(logits, metadata)  # [num_rows]
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids, None, None, None)
        return self.gather_logprobs(raw_logprobs, sampled_token_ids, metadata.max_num_logprobs)

    def apply_constraints(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Banned tokens and penalties: what both greedy and random rows obey."""
        if metadata.banned_token_ids is not None:
            logits = ops.apply_banned_tokens(logits, metadata.banned_token_ids)
        if not metadata.no_penalties:
            if metadata.output_token_counts is None:
                raise ValueError("SamplingMetadata.no_penalties is False but output_token_counts is None")
            if use_triton(logits):
                return triton_module("weir.sample.triton_penalties").apply_penalties_triton(logits, metadata)
            batch = metadata.gathered()
            logits = ops.apply_penalties(
                logits,
                batch.prompt_token_mask,
                batch.output_token_counts,
                batch.repetition_penalty,
                batch.frequency_penalty,
                batch.presence_penalty,
            )
        return logits

    def choose_tokens(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Argmax for greedy rows, Gumbel-max over the filtered distribution for random rows.

        On CUDA the Triton kernels (``weir.sample.triton_sampler``) do the random rows, and the
        greedy rows of a mixed batch, without sorting or materialising the noise.
        """
        if metadata.all_greedy:
            return logits.argmax(dim=-1)  # [num_rows]
        if use_triton(logits):
            return triton_module("weir.sample.triton_sampler").choose_tokens_triton(logits, metadata)
        batch = metadata.gathered()
        greedy_token_ids = None if batch.all_random else logits.argmax(dim=-1)  # [num_rows]
        logits = ops.apply_temperature(logits, batch.temperature)
        if not batch.no_min_p:
            logits = ops.apply_min_p(logits, batch.min_p)
        logits = ops.apply_top_k_top_p(
            logits,
            None if batch.no_top_k else batch.top_k,
            None if batch.no_top_p else batch.top_p,
        )
        noise = ops.gumbel_noise(batch.seeds, batch.positions, logits.shape[-1])  # [num_rows, vocab]
        random_token_ids = (logits + noise).argmax(dim=-1)  # [num_rows]
        if batch.all_random:
            return random_token_ids
        # top_k == 1 is greedy too: ties at the maximum must resolve exactly as argmax does.
        is_greedy = (batch.temperature == 0) | (batch.top_k == 1)  # [num_rows]
        return torch.where(is_greedy, greedy_token_ids, random_token_ids)

    @staticmethod
    def gather_logprobs(
        raw_logprobs: torch.Tensor,  # [num_rows, vocab] fp32
        sampled_token_ids: torch.Tensor,  # [num_rows] int64
        num_logprobs: int,
    ) -> SamplerOutput:
        """The sampled token's logprob and rank, plus the ``num_logprobs`` largest logprobs."""
        sampled_column = sampled_token_ids.unsqueeze(1)  # [num_rows, 1]
        sampled_logprobs = raw_logprobs.gather(1, sampled_column)  # [num_rows, 1]
        # Rank 1 is the most likely token; ties share the better rank.
        ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1  # [num_rows]
        num_top = min(num_logprobs, raw_logprobs.shape[-1])
        top_logprobs, top_token_ids = raw_logprobs.topk(num_top, dim=-1)  # [num_rows, num_top]
        return SamplerOutput(
            sampled_token_ids=sampled_token_ids,
            logprob_token_ids=torch.cat([sampled_column, top_token_ids], dim=1),
            logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
            sampled_token_ranks=ranks,
        )
