"""Acceptance counts of speculative decoding: per request (vLLM's ``metrics.speculative_decoding``
object of a response) and for the whole engine (the Prometheus counters).

A *spec step* of a request is a step that verified at least one draft of it. Of each such step
the counts keep the drafts verified and the drafts accepted (the bonus token every step samples
is not a draft): ``mean_acceptance_length = 1 + accepted / spec steps`` (tokens per spec step),
``draft_acceptance_rate = accepted / drafts``, and ``acceptance_histogram[j]`` = the spec steps
that accepted exactly ``j`` drafts.

The counts are the verifier's: a draft the target accepted counts even where a stop (EOS, a stop
token or string, ``max_tokens``) earlier in the same step keeps it out of the output, as vLLM
counts them (its scheduler records a step's acceptance before it checks the stop). They measure
the drafts, not the completion's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestSpecStats:
    """One request's (one completion's) acceptance so far."""

    num_spec_tokens: int  # the most drafts a step verifies (num_speculative_tokens)
    detailed: bool = False  # keep every step's counts too
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.acceptance_histogram:
            self.acceptance_histogram = [0] * (self.num_spec_tokens + 1)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One step that verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        if num_drafts <= 0:
            return
        if not 0 <= num_accepted <= num_drafts <= self.num_spec_tokens:
            raise ValueError(f"a spec step accepted {num_accepted} of {num_drafts} drafts (at most "
                             f"{self.num_spec_tokens} per step)")
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_draft_tokens += num_accepted
        self.acceptance_histogram[num_accepted] += 1
        if self.detailed:
            self.per_step_accepted.append(num_accepted)
            self.per_step_drafted.append(num_drafts)

    def merged(self, other: RequestSpecStats) -> RequestSpecStats:
        """Both requests' counts (a response with several completions reports their sum)."""
        size = max(len(self.acceptance_histogram), len(other.acceptance_histogram))
        histogram = [0] * size
        for counts in (self.acceptance_histogram, other.acceptance_histogram):
            for index, count in enumerate(counts):
                histogram[index] += count
        return RequestSpecStats(
            max(self.num_spec_tokens, other.num_spec_tokens), self.detailed and other.detailed,
            self.num_spec_steps + other.num_spec_steps, self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_draft_tokens + other.num_accepted_draft_tokens, histogram,
            self.per_step_accepted + other.per_step_accepted, self.per_step_drafted + other.per_step_drafted)

    def copy(self, with_steps: bool = True) -> RequestSpecStats:
        """A snapshot; ``with_steps=False`` leaves the per-step lists out (what a streamed output
        that is not the last needs, so each step's copy stays small)."""
        return RequestSpecStats(self.num_spec_tokens, self.detailed and with_steps, self.num_spec_steps,
                                self.num_draft_tokens, self.num_accepted_draft_tokens, list(self.acceptance_histogram),
                                list(self.per_step_accepted) if with_steps else [],
                                list(self.per_step_drafted) if with_steps else [])

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_draft_tokens / self.num_spec_steps if self.num_spec_steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_dict(self, detailed: bool = False) -> dict:
        """vLLM's ``metrics.speculative_decoding`` object (``detailed``: with every step's counts)."""
        body = {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": list(self.acceptance_histogram),
            "num_spec_steps": self.num_spec_steps,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
        }
        if detailed:
            body["per_step_accepted"] = list(self.per_step_accepted)
            body["per_step_drafted"] = list(self.per_step_drafted)
        return body


@dataclass
class SpecDecodeCounters:
    """The engine's running totals (Prometheus counters: drafts, draft tokens, accepted tokens,
    accepted per draft position)."""

    num_spec_tokens: int
    num_drafts: int = 0  # spec steps, summed over requests
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Draft slots scheduled (verified positions the steps paid for, drafts or not): not a vLLM counter.
    num_draft_slots: int = 0

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_spec_tokens

    def observe(self, num_drafts: int, num_accepted: int, num_slots: int = 0) -> None:
        self.num_draft_slots += num_slots
        if num_drafts <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position), "num_draft_slots": self.num_draft_slots}
