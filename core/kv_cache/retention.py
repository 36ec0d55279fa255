"""Which block boundaries of a request stay reusable by later prefix hits (the retention rule).

A full-attention group can resume from any block boundary its cached blocks reach. A windowed
group needs the window's blocks before the boundary, and linear-attention layers need a state
checkpoint at exactly that boundary: keeping either at every boundary would fill the cache with
entries no request reads. So, per request, the KV manager keeps them only at its *retained
boundaries* (token counts, multiples of the block size), fixed when it is admitted:

- ``interval == 0`` (the default, as vLLM's ``--prefix-cache-retention-interval``): the last
  block boundary before the last known token (the next turn of a chat, which extends the
  prompt, hits there, and so does the same prompt sent again), and the *junction*: where the
  request's shared prefix with what the cache already holds ends, so that the next request
  sharing that prefix hits all of it (a long system prompt);
- ``interval == N > 0``: every N tokens, and the last boundary as above (no junctions);
- ``interval is None`` (dense: every block boundary; what a windowed group kept before there was
  a rule, and what ``N == block_size`` gives within the known tokens).

"Known tokens" are the prompt, or for a request resumed after preemption its prompt and outputs
so far: what its prefill computes.
"""

from __future__ import annotations


def retained_boundaries(num_known_tokens: int, block_size: int, interval: int | None,
                        junction: int = 0) -> tuple[int, ...]:
    """The request's retained boundaries, ascending (see the module docstring)."""
    last = (num_known_tokens - 1) // block_size * block_size
    if last <= 0:
        return ()
    if interval is None:
        return tuple(range(block_size, last + 1, block_size))
    points = {last}
    if interval > 0:
        points.update(range(interval, last + 1, interval))
    elif 0 < junction < last:
        points.add(junction)
    return tuple(sorted(points))


def describe_retention(interval: int) -> str:
    """What the start-up log says of the rule."""
    if interval == 0:
        return ("retention interval 0: each prompt's last block boundary and the junctions where prompts "
                "sharing a prefix diverge")
    return f"retention interval {interval}: every {interval} tokens of each prompt and its last block boundary"
