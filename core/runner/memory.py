"""Sizing the KV cache from a profiling run on accelerators.

The profile runs one forward at ``max_num_batched_tokens`` (the largest step the scheduler
can issue) plus the sampler at ``max_num_seqs`` rows, against a one-block scratch cache, and
records the peak memory it allocated beyond the weights. Before it, ``weir.runner.warmup``
compiles the kernel variants real steps will launch (in parallel), so that neither the profile
nor the first requests wait on Triton's compiler.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from weir.runner.warmup import dummy_forward, scratch_caches
from weir.sample import Sampler
from weir.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def split_tokens(num_tokens: int, max_len: int, max_reqs: int) -> list[int]:
    """Query lengths of a dummy batch of ``num_tokens`` tokens: as few requests as fit."""
    num_reqs = min(max_reqs, max(1, math.ceil(num_tokens / max_len)))
    base, extra = divmod(num_tokens, num_reqs)
    return [min(max_len, base + (1 if i < extra else 0)) for i in range(num_reqs)]


def profile_peak_bytes(runner) -> tuple[int, int]:
    """(peak bytes of the largest step, peak bytes of the largest decode graph batch),
    each beyond what was allocated before the profile."""
    scheduler = runner.config.scheduler
    scratch = scratch_caches(runner)

    def peak_of(fn) -> int:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
        fn()
        torch.cuda.synchronize(runner.device)
        return torch.cuda.max_memory_allocated(runner.device) - before

    def largest_step():
        query_lens = split_tokens(scheduler.max_num_batched_tokens, scheduler.max_model_len,
                                  scheduler.max_num_seqs)
        if runner.state_layers:
            # Hybrid models: the largest step also carries a full batch of decodes (their
            # linear-attention kernels and buffers) beside the prefill chunk, as mixed steps do.
            num_decodes = min(runner.num_state_slots, scheduler.max_num_seqs, scheduler.max_num_batched_tokens) - 1
            query_lens = [1] * num_decodes + split_tokens(
                scheduler.max_num_batched_tokens - num_decodes, scheduler.max_model_len, scheduler.max_num_seqs)
        dummy_forward(runner, query_lens, scratch)
        num_rows = scheduler.max_num_seqs
        logits = torch.randn(num_rows, runner.config.model.vocab_size, device=runner.device)
        # The costliest sampling: penalties ([rows, vocab] counts and masks) and full logprobs.
        params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1,
                                logprobs=runner.config.max_logprobs)
        sampler = Sampler.for_params([params] * num_rows, seeds=list(range(num_rows)), vocab_size=logits.shape[1],
                                     device=runner.device, output_token_ids=[[1]] * num_rows,
                                     prompt_token_ids=[[2]] * num_rows)
        positions = torch.ones(num_rows, dtype=torch.int32, device=runner.device)
        sampler.sample(logits, torch.arange(num_rows, device=runner.device), np.arange(num_rows), positions)

    start = time.perf_counter()
    step_peak = peak_of(largest_step)
    logger.info("profiling run: %.1f s", time.perf_counter() - start)
    decode_peak = peak_of(lambda: dummy_forward(runner, [1] * runner.max_graph_batch, scratch))
    scratch.clear()  # free the scratch cache before the real one is sized
    torch.cuda.empty_cache()
    return step_peak, decode_peak
