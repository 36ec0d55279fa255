"""Sizing the KV cache from a profiling run on accelerators.

The profile runs one forward at ``max_num_batched_tokens`` (the largest step the scheduler
can issue) plus the sampler at ``max_num_seqs`` rows, against a one-block scratch cache, and
records the peak memory it allocated beyond the weights. It also compiles the kernels the
first real prefill would otherwise compile.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from weir.attention import AttentionMetadata
from weir.sample.metadata import build_sampling_metadata
from weir.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def split_tokens(num_tokens: int, max_len: int, max_reqs: int) -> list[int]:
    """Query lengths of a dummy batch of ``num_tokens`` tokens: as few requests as fit."""
    num_reqs = min(max_reqs, max(1, math.ceil(num_tokens / max_len)))
    base, extra = divmod(num_tokens, num_reqs)
    return [min(max_len, base + (1 if i < extra else 0)) for i in range(num_reqs)]


@torch.inference_mode()
def dummy_forward(runner, query_lens: list[int], kv_caches) -> torch.Tensor:
    """A forward over fake requests whose keys all live in the null block (block 0)."""
    device, block_size = runner.device, runner.block_size
    num_tokens = sum(query_lens)
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    positions = np.concatenate([np.arange(n) for n in query_lens])
    max_blocks = math.ceil(max(query_lens) / block_size)
    metadata = AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(query_lens), max_blocks, dtype=torch.int32, device=device),
        slot_mapping=torch.from_numpy(positions % block_size).to(device),
        num_reqs=len(query_lens), num_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    # Hybrid models: every fake request uses the padding state slot (garbage state is fine there).
    state_indices = torch.full((len(query_lens),), runner.num_state_slots, dtype=torch.int32, device=device)
    ctx = runner.forward_context(metadata, kv_caches, state_indices, torch.from_numpy(qsl))
    hidden = runner.model(input_ids, torch.from_numpy(positions).to(device), ctx)
    return runner.model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])


def profile_peak_bytes(runner) -> tuple[int, int]:
    """(peak bytes of the largest step, peak bytes of the largest decode graph batch),
    each beyond what was allocated before the profile."""
    scheduler = runner.config.scheduler
    scratch = [None] * len(runner.kv_caches)
    for layer in runner.attn_layers:
        shape = runner.attn_backend.kv_cache_shape(1, layer)
        scratch[layer.layer_idx] = torch.zeros(shape, dtype=runner.dtype, device=runner.device)

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
        metadata = build_sampling_metadata([params] * num_rows, seeds=list(range(num_rows)),
                                           positions=[1] * num_rows, vocab_size=logits.shape[1],
                                           device=runner.device, output_token_ids=[[1]] * num_rows,
                                           prompt_token_ids=[[2]] * num_rows)
        runner.sampler.sample(logits, metadata)

    def warm_up_variants():
        # Kernels specialise on shape classes (a prefill tile per query-length class, sampler
        # filters): compile each now rather than inside the first requests that need it.
        query_len = 2
        while query_len <= min(256, scheduler.max_num_batched_tokens - 1):
            dummy_forward(runner, [1, query_len], scratch)
            query_len *= 2
        kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9),
                 SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.7, min_p=0.1),
                 SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, logprobs=2)]
        logits = torch.randn(len(kinds), runner.config.model.vocab_size, device=runner.device)
        for params in (kinds, kinds[1:2], kinds[2:3]):
            metadata = build_sampling_metadata(params, seeds=list(range(len(params))), positions=[1] * len(params),
                                               vocab_size=logits.shape[1], device=runner.device,
                                               output_token_ids=[[1]] * len(params),
                                               prompt_token_ids=[[2]] * len(params))
            runner.sampler.sample(logits[: len(params)], metadata)

    start = time.perf_counter()
    step_peak = peak_of(largest_step)
    warm_up_variants()
    logger.info("profiling run and kernel warm-up: %.1f s", time.perf_counter() - start)
    decode_peak = peak_of(lambda: dummy_forward(runner, [1] * runner.max_graph_batch, scratch))
    scratch.clear()  # free the scratch cache before the real one is sized
    torch.cuda.empty_cache()
    return step_peak, decode_peak
