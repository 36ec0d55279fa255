"""The scheduler's side of speculative decoding: drafts within the one token budget, and the
results of verifying steps.

A decoding request is owed one token (its last sampled one). With drafts waiting on the device
it is scheduled ``1 + k`` tokens: that token and ``k`` drafts after it (vLLM's
``num_tokens_with_spec``), within the step's token budget. The host plans as if every draft will
be accepted: it counts ``1 + k`` output placeholders and ``1 + k`` computed tokens, and when the
step's result arrives (a step late under async scheduling) takes the rejected drafts back out of
both. The device is exact all along: its post-update advances ``num_computed_tokens`` by the
accepted count, so the next step's positions never wait for the host.
"""

from __future__ import annotations

from weir.request import Request, RequestStatus
from weir.spec_decode.adaptive import AdaptiveDrafts
from weir.spec_decode.config import SpeculativeConfig
from weir.spec_decode.stats import RequestSpecStats, SpecDecodeCounters


class SpecScheduling:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, detailed_stats: bool):
        self.config = config
        self.max_model_len = max_model_len
        self.detailed_stats = detailed_stats
        self.counters = SpecDecodeCounters(config.num_speculative_tokens)

    def prepare(self, request: Request) -> None:
        """Give a request its acceptance state when it is added."""
        config = self.config
        request.adaptive = AdaptiveDrafts(config.num_speculative_tokens, config.verification_cost)
        request.spec_stats = RequestSpecStats(config.num_speculative_tokens, self.detailed_stats)

    def num_drafts(self, request: Request, owed: int, num_running: int) -> int:
        """Drafts to verify in this request's next step (0: none wait, or none would pay)."""
        if owed != 1 or not request.drafts_ready:
            return 0  # a prefill chunk, or no sampling step since the request (re)started
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return 0
        wanted = (request.adaptive.next_num_drafts() if self.config.adaptive
                  else self.config.num_speculative_tokens)
        # Every draft may be accepted, and the step samples one token more: neither may pass
        # max_tokens (which also keeps every position inside max_model_len).
        room = request.max_tokens - request.num_outputs_with_placeholders - 1
        return max(0, min(wanted, room))

    def lookahead(self, request: Request, num_computed: int, num_new: int) -> int:
        """KV slots past this step's tokens that proposing writes, within max_model_len: only
        for a step that samples (proposing follows it). A partial prefill chunk gets none, as
        its blocks are registered in the prefix cache up to its known tokens, which must then
        have the target's KV of this step."""
        if num_computed + num_new < request.num_tokens_with_placeholders:
            return 0
        room = self.max_model_len - num_computed - num_new
        return max(0, min(self.config.num_lookahead_tokens, room))

    def apply_result(self, request: Request, num_scheduled_drafts: int, num_verified: int,
                     num_accepted: int) -> None:
        """Take the rejected drafts back out of the computed tokens; record the step. (The
        scheduler resolves the step's ``1 + num_scheduled_drafts`` placeholders itself.)"""
        if request.status == RequestStatus.RUNNING and request.num_computed_tokens > 0:
            # A preempted request restarts from zero anyway.
            request.num_computed_tokens -= num_scheduled_drafts - num_accepted
        request.adaptive.observe(num_scheduled_drafts, num_accepted)
        request.spec_stats.observe(num_verified, num_accepted)
        self.counters.observe(num_verified, num_accepted, num_scheduled_drafts)
