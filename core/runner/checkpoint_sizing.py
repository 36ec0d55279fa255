"""How many linear-attention state checkpoints a hybrid model's prefix cache keeps.

Checkpoints (``weir.kv_cache.state_checkpoints``) are paid from the KV cache's budget, beside the
paged blocks. Rule: at most ``CHECKPOINT_SHARE`` of the budget; no more than the blocks of the
first cache group (the full-attention one when there is one: every checkpoint ends at a distinct
cached block there, so more could never be hit); and never so many that the paged groups could
no longer hold one ``max_model_len`` request. None fitting turns prefix caching off for the model
(the engine says so).

Why a quarter: a checkpoint is large (Qwen3-Next-80B: 74 MiB, the KV of ~3,000 tokens), and with
retention interval 0 each cached prompt keeps one or two; a quarter of the budget keeps hundreds
of them on an accelerator while the KV cache keeps three quarters of its tokens.
"""

from __future__ import annotations

from collections.abc import Callable

CHECKPOINT_SHARE = 0.25


def split_with_checkpoints(budget: int, checkpoint_bytes: int, min_paged_bytes: int,
                           split: Callable[[int], list[int]]) -> tuple[list[int], int]:
    """(blocks per group, checkpoint slots) for ``budget`` bytes; ``split(bytes)`` divides bytes
    among the paged groups (``weir.runner.kv_sizing.split_blocks``), ``min_paged_bytes`` is what
    one ``max_model_len`` request needs there."""
    num_checkpoints = max(0, min(int(budget * CHECKPOINT_SHARE), budget - min_paged_bytes)) // checkpoint_bytes
    num_blocks = split(budget - num_checkpoints * checkpoint_bytes)
    useful = max(num_blocks[0] - 1, 0)  # the null block holds no prefix
    if num_checkpoints > useful:
        num_checkpoints = useful
        num_blocks = split(budget - num_checkpoints * checkpoint_bytes)
    return num_blocks, num_checkpoints
