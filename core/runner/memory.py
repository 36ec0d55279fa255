"""Profiling the memory of the largest step on accelerators, through the runner's own step.

The profile runs ``ModelRunner.dummy_run`` at the largest step the scheduler can issue: as many
requests as can run at once, one of them prefilling the rest of ``max_num_batched_tokens``, each
sampling with penalties and full logprobs (the costliest sampling). It records the peak memory
the step allocated beyond what stays allocated after it (persistent state, such as the sampler's
penalty counts, is then already counted as used memory). Before it, ``weir.runner.warmup``
compiles the kernel variants real steps will launch, so neither the profile nor the first
requests wait on Triton's compiler.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from weir.runner.cuda_graphs import mixed_capture_lens
from weir.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def split_tokens(num_tokens: int, max_len: int, max_reqs: int) -> list[int]:
    """Query lengths of a dummy batch of ``num_tokens`` tokens: as few requests as fit."""
    num_reqs = min(max_reqs, max(1, math.ceil(num_tokens / max_len)))
    base, extra = divmod(num_tokens, num_reqs)
    return [min(max_len, base + (1 if i < extra else 0)) for i in range(num_reqs)]


def largest_step(num_batched_tokens: int, max_model_len: int, max_reqs: int) -> list[int]:
    """Query lengths of the largest step: decodes for every request but the prefill chunks, which
    take the rest of the token budget in as few requests as fit."""
    prefill_tokens = max(1, num_batched_tokens - (max_reqs - 1))
    prefills = split_tokens(prefill_tokens, max_model_len - 1, max_reqs)
    num_decodes = min(max_reqs - len(prefills), num_batched_tokens - sum(prefills))
    return [1] * max(num_decodes, 0) + prefills


def profile_peak_bytes(runner) -> tuple[int, int, int]:
    """Peak bytes of the largest step, of the widest decode graph batch and of the largest
    mixed-step graph shape (0 without mixed-step graphs), each beyond what is allocated once the
    step is over."""
    scheduler = runner.config.scheduler

    def peak_of(fn) -> int:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        fn()
        torch.cuda.synchronize(runner.device)
        return torch.cuda.max_memory_allocated(runner.device) - torch.cuda.memory_allocated(runner.device)

    query_lens = largest_step(scheduler.max_num_batched_tokens, scheduler.max_model_len, runner.max_running_reqs)
    costliest = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, logprobs=runner.config.max_logprobs)
    start = time.perf_counter()
    step_peak = peak_of(lambda: runner.dummy_run(query_lens, sampling_params=[costliest] * len(query_lens),
                                                 graph_mode="off"))
    logger.info("profiling run: %d requests, %d tokens, %.1f s", len(query_lens), sum(query_lens),
                time.perf_counter() - start)
    # The widest decode graph family: one token per request, or 1 + drafts under speculation.
    # With graphs, on the capture's own plan ("warm"): its baked bounds (max_seq_len =
    # max_model_len) size buffers that the step's own would not, such as DSA's indexer scores.
    width = max(getattr(runner, "graph_widths", [1]))
    graph_mode = "warm" if getattr(runner, "use_graphs", False) else "off"
    decode_peak = peak_of(lambda: runner.dummy_run([width] * runner.max_graph_batch, graph_mode=graph_mode,
                                                   num_draft_tokens=[width - 1] * runner.max_graph_batch))
    mixed_peak = 0
    mixed_shapes = getattr(runner, "mixed_graph_shapes", [])
    if mixed_shapes:  # the largest mixed-step graph's, which may outgrow every decode one
        query_lens = mixed_capture_lens(*mixed_shapes[0], scheduler.max_model_len)
        mixed_peak = peak_of(lambda: runner.dummy_run(query_lens, graph_mode="warm"))
    torch.cuda.empty_cache()
    if getattr(runner.config, "speculative", None) is not None:
        # A verify step samples 1 + k rows a request ([rows, vocab] buffers): it may outgrow the
        # largest prefill step, graphs or not.
        step_peak = max(step_peak, decode_peak)
    return step_peak, decode_peak, mixed_peak
