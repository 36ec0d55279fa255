"""How many blocks each paged cache group gets.

The budget is ``--kv-cache-memory-bytes``, or on the CPU the platform's default allowance, or on
accelerators what ``--gpu-memory-utilization`` leaves after the weights, the state slots, the
profiled peak of the largest step and the CUDA graphs' pool (``weir.runner.memory``).

Split rule: a group never gets more blocks than it can use. A full-attention group can use every
running request at ``max_model_len``; a windowed group only each running request's window, plus
one step's new tokens. Every group gets the same number of blocks N, or its cap if smaller, with
the largest N the budget pays for: a windowed group caps early, and what it does not need goes to
the full-attention groups as more tokens of context. A hybrid model with prefix caching also
pays its linear-attention state checkpoints from the budget (``weir.runner.checkpoint_sizing``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from weir.runner.checkpoint_sizing import split_with_checkpoints
from weir.runner.cuda_graphs import graph_pool_bytes_estimate
from weir.runner.memory import profile_peak_bytes

logger = logging.getLogger(__name__)
GiB = 2**30


@dataclass(frozen=True)
class KVSizing:
    num_blocks: list[int]  # per group, the null block included
    graph_reserve_bytes: int  # what the budget left for the CUDA graphs' pool
    num_checkpoints: int = 0  # linear-attention state checkpoints of the prefix cache


def useful_blocks(sliding_window: int | None, block_size: int, max_running_reqs: int, max_blocks_per_req: int,
                  max_num_batched_tokens: int) -> int:
    """The most blocks a group can hold at once (null block included)."""
    full = max_running_reqs * max_blocks_per_req + 1
    if sliding_window is None:
        return full
    # Each request holds the blocks of its window before its next query (one more when the window
    # straddles a block boundary) and the blocks of the tokens one step adds.
    per_request = -(-(sliding_window - 1) // block_size) + 2
    step_tokens = -(-max_num_batched_tokens // block_size)
    return min(full, max_running_reqs * per_request + step_tokens + 1)


def blocks_one_request_needs(sliding_window: int | None, block_size: int, max_model_len: int,
                             max_num_batched_tokens: int) -> int:
    """Blocks (null block excluded) a lone request of ``max_model_len`` tokens can hold at once."""
    whole = -(-max_model_len // block_size)
    if sliding_window is None:
        return whole
    return min(whole, -(-(sliding_window - 1 + max_num_batched_tokens) // block_size) + 1)


def split_blocks(budget: int, bytes_per_block: list[int], caps: list[int]) -> list[int]:
    """The largest N with ``sum(min(N, cap) * bytes) <= budget``, as blocks per group."""
    def cost(n: int) -> int:
        return sum(min(n, cap) * per_block for cap, per_block in zip(caps, bytes_per_block))

    low, high = 0, max(caps)
    while low < high:
        mid = (low + high + 1) // 2
        if cost(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    return [min(low, cap) for cap in caps]


def group_windows(runner) -> list[int | None]:
    """Each paged group's window as the KV cache must keep it (None: full attention)."""
    config = runner.config
    # Under speculation a windowed group keeps the blocks of drafts still being verified too (the
    # device's next query may start that many tokens earlier): the window reaches back that far.
    lookback = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return [None if group.sliding_window is None else group.sliding_window + lookback
            for group in runner.caches.groups]


def one_request_blocks(runner) -> list[int]:
    """Per paged group, the blocks (null block excluded) one request of ``max_model_len`` holds."""
    scheduler = runner.config.scheduler
    return [blocks_one_request_needs(window, runner.block_size, scheduler.max_model_len,
                                     scheduler.max_num_batched_tokens) for window in group_windows(runner)]


def least_paged_bytes(needed_blocks: list[int], bytes_per_block: list[int], caps: list[int] | None = None) -> int:
    """Bytes the paged groups take once the neediest holds one request: ``split_blocks`` gives
    every group the same count (null block included) or its cap if smaller (None: no caps)."""
    most_needed = max(needed_blocks) + 1
    caps = caps or [most_needed] * len(needed_blocks)
    return sum(min(most_needed, cap) * per_block for cap, per_block in zip(caps, bytes_per_block))


def one_request_kv_bytes(runner) -> int:
    """The least the paged caches must get, before the running-request caps are known (so
    uncapped) and draft layers left out: the state slots of a hybrid model are sized after
    setting this aside (``ModelRunner._state_room_bytes``)."""
    return least_paged_bytes(one_request_blocks(runner),
                             [runner.caches.bytes_per_block(group) for group in runner.caches.groups])


def size_kv_cache(runner) -> KVSizing:
    config = runner.config
    scheduler, cache = config.scheduler, config.cache
    groups = runner.caches.groups
    budget, graph_reserve = _budget_bytes(runner)
    bytes_per_block = [runner.caches.bytes_per_block(group) + runner.extra_kv_bytes_per_block(g)
                       for g, group in enumerate(groups)]
    caps = [useful_blocks(window, runner.block_size, runner.max_running_reqs, runner.max_blocks_per_req,
                          scheduler.max_num_batched_tokens) for window in group_windows(runner)]
    needed_blocks = one_request_blocks(runner)
    checkpoint_bytes = runner.linear_state.bytes_per_slot if (
        cache.enable_prefix_caching and runner.linear_state is not None) else 0
    num_checkpoints = 0
    if checkpoint_bytes:
        min_paged = least_paged_bytes(needed_blocks, bytes_per_block, caps)
        num_blocks, num_checkpoints = split_with_checkpoints(
            max(budget, 0), checkpoint_bytes, min_paged, lambda paged: split_blocks(paged, bytes_per_block, caps))
    else:
        num_blocks = split_blocks(max(budget, 0), bytes_per_block, caps)
    for group, blocks, needed in zip(groups, num_blocks, needed_blocks):
        if blocks - 1 < needed:
            # How much of one full-attention request the budget holds (vLLM's error estimates it too).
            fits = max(blocks - 1, 0) * runner.block_size
            estimate = f" (about max_model_len={fits} fits)" if group.sliding_window is None and fits else ""
            raise ValueError(
                f"the KV cache budget ({budget / GiB:.2f} GiB) gives the cache group of {group.describe()} "
                f"{max(blocks - 1, 0)} blocks of {runner.block_size} tokens, fewer than one request of "
                f"max_model_len={scheduler.max_model_len} needs ({needed}){estimate}; raise kv_cache_memory_bytes "
                f"(or gpu_memory_utilization) or lower "
                f"{'max_model_len' if group.sliding_window is None else 'max_model_len or max_num_batched_tokens'}")
    total = sum(blocks * per_block for blocks, per_block in zip(num_blocks, bytes_per_block))
    logger.info("KV cache: %.2f GiB%s; %s", total / GiB, f" of a {budget / GiB:.2f} GiB budget" if budget > total else "",
                "; ".join(f"{group.describe()}: {blocks - 1} blocks of {runner.block_size} tokens = "
                          f"{(blocks - 1) * runner.block_size} tokens"
                          for group, blocks in zip(groups, num_blocks)))
    return KVSizing(num_blocks, graph_reserve, num_checkpoints)


def _budget_bytes(runner) -> tuple[int, int]:
    """(bytes the paged caches may take, bytes kept for the CUDA graphs' pool)."""
    cache = runner.config.cache
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes, 0
    if runner.device.type == "cpu":  # the state slots came out of the same default allowance
        state_bytes = runner.linear_state.total_bytes if runner.linear_state is not None else 0
        return runner.platform.default_kv_cache_bytes(runner.weight_bytes) - state_bytes, 0
    # Accelerators: the state is already allocated, so memory_info no longer counts it as free.
    step_peak, decode_peak, mixed_peak = profile_peak_bytes(runner)
    graph_reserve = 0
    if runner.use_graphs:
        logits_row_bytes = runner.config.model.vocab_size * runner.dtype.itemsize
        graph_reserve = graph_pool_bytes_estimate(decode_peak + mixed_peak, runner.capture_sizes, logits_row_bytes)
    free, total = runner.platform.memory_info()
    budget = int(total * cache.gpu_memory_utilization) - (total - free) - step_peak - graph_reserve
    logger.info("memory: weights %.2f GiB, activations %.2f GiB, graphs (reserved) %.2f GiB, "
                "KV budget %.2f GiB of %.2f GiB x %.2f", runner.weight_bytes / GiB, step_peak / GiB,
                graph_reserve / GiB, budget / GiB, total / GiB, cache.gpu_memory_utilization)
    return budget, graph_reserve
