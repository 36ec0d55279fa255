"""Adaptive verification: how many drafts to verify for one request in its next step.

Rule. Model a request's drafts as accepted one after another, each with the same probability
``a`` (its acceptance rate). Verifying ``k`` drafts then yields ``(1 - a**(k + 1)) / (1 - a)``
tokens in expectation (the accepted drafts plus the token the step samples) for a step that
costs ``1 + c * k`` decode steps (``c``: ``verification_cost``, what one more verified position
costs relative to a decode step). The next step verifies the ``k`` in ``0..num_speculative_tokens``
with the most expected tokens per cost.

``a`` is estimated per request from its own steps so far: each verified step contributes its
accepted drafts as successes and, when it stopped before its last draft, one failure (the
maximum-likelihood estimate of ``a`` for that model), both decayed by ``DECAY`` per step so the
estimate follows a request whose text changes character (a quote that ends, a list that starts).
Slots the proposer left empty (an n-gram with no match) count as failures: they are verified
positions that yield nothing. The prior is half a success and half a failure, so a new request
starts at ``a = 0.5``, and a request that stopped drafting (``k = 0``) drifts back towards it
as its counts decay, which probes it again after a few steps.

Logprobs stay exact whatever ``k`` is: every emitted token's logprobs come from the target's
logits at its own position.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8
PRIOR = 0.5


def best_num_drafts(acceptance: float, max_drafts: int, verification_cost: float) -> int:
    """The ``k`` in ``0..max_drafts`` with the most expected tokens per unit of step cost."""
    best_k, best_value = 0, 1.0
    expected, reach = 1.0, 1.0
    for k in range(1, max_drafts + 1):
        reach *= acceptance  # probability that the first k drafts are all accepted
        expected += reach
        value = expected / (1.0 + verification_cost * k)
        if value > best_value * (1 + 1e-9):
            best_k, best_value = k, value
    return best_k


@dataclass
class AdaptiveDrafts:
    """One request's decayed acceptance counts and the drafts its next step verifies."""

    max_drafts: int
    verification_cost: float
    successes: float = 0.0
    failures: float = 0.0

    @property
    def acceptance(self) -> float:
        return (self.successes + PRIOR) / (self.successes + self.failures + 2 * PRIOR)

    def next_num_drafts(self) -> int:
        return best_num_drafts(self.acceptance, self.max_drafts, self.verification_cost)

    def observe(self, num_scheduled: int, num_accepted: int) -> None:
        """A step that scheduled ``num_scheduled`` draft slots (0: a plain decode) and accepted
        the first ``num_accepted``."""
        self.successes *= DECAY
        self.failures *= DECAY
        if num_scheduled > 0:
            self.successes += num_accepted
            self.failures += 1.0 if num_accepted < num_scheduled else 0.0
