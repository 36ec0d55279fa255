"""The sampler: logits of one step -> sampled token ids (and logprobs), all on the device.

Order, as vLLM: logprobs of the raw logits (before any processing); banned tokens; penalties;
then greedy rows take the argmax and random rows go through temperature, min-p, top-k/top-p
and Gumbel-max with noise keyed on (seed, position, token). Greedy and random rows are merged
with ``torch.where``; only host flags decide which work runs, so nothing here waits on the device.
On CUDA the token choice runs as Triton kernels (``WEIR_DISABLE_TRITON=1`` forces the torch ops,
which stay the reference and the path on every other device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weir.kernels.dispatch import triton_module, use_triton
from weir.sample import ops
from weir.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """One step's samples; every tensor stays on the device until the runner copies it."""

    sampled_token_ids: torch.Tensor  # [num_rows] int64
    # Column 0 is the sampled token, columns 1..k the k most likely under the raw logits.
    logprob_token_ids: torch.Tensor | None  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor | None  # [num_rows, 1 + k] fp32
    sampled_token_ranks: torch.Tensor | None  # [num_rows] int64, 1 = the most likely token


class Sampler:
    """Stateless: every per-request input arrives in the ``SamplingMetadata``."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, metadata)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([num_rows, vocab], fp32 or the model's dtype);
        ``logits`` is not modified."""
        fused_path = (use_triton(logits) and metadata.no_penalties and metadata.banned_token_ids is None
                      and metadata.max_num_logprobs is None)
        if logits.dtype != torch.float32 and not (fused_path or metadata.all_greedy):
            logits = logits.float()  # torch ops and logprobs work in fp32; the kernels upcast in registers
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
            logits = ops.apply_penalties(
                logits,
                metadata.prompt_token_mask,
                metadata.output_token_counts,
                metadata.repetition_penalty,
                metadata.frequency_penalty,
                metadata.presence_penalty,
            )
        return logits

    def choose_tokens(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Argmax for greedy rows, Gumbel-max over the filtered distribution for random rows.

        On CUDA the Triton kernels (``weir.kernels.triton_sampler``) do the random rows, and
        the greedy rows of a mixed batch, without sorting or materialising the noise.
        """
        if metadata.all_greedy:
            return logits.argmax(dim=-1)  # [num_rows]
        if use_triton(logits):
            return triton_module("triton_sampler").choose_tokens_triton(logits, metadata)
        greedy_token_ids = None if metadata.all_random else logits.argmax(dim=-1)  # [num_rows]
        logits = ops.apply_temperature(logits, metadata.temperature)
        if not metadata.no_min_p:
            logits = ops.apply_min_p(logits, metadata.min_p)
        logits = ops.apply_top_k_top_p(
            logits,
            None if metadata.no_top_k else metadata.top_k,
            None if metadata.no_top_p else metadata.top_p,
        )
        noise = ops.gumbel_noise(metadata.seeds, metadata.positions, logits.shape[-1])  # [num_rows, vocab]
        random_token_ids = (logits + noise).argmax(dim=-1)  # [num_rows]
        if metadata.all_random:
            return random_token_ids
        # top_k == 1 is greedy too: ties at the maximum must resolve exactly as argmax does.
        is_greedy = (metadata.temperature == 0) | (metadata.top_k == 1)  # [num_rows]
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
