"""Admission control: bound the work in flight, and answer 503 at once past the bounds.

Two limits: requests admitted and not yet answered (``--max-num-queued-reqs``), and prompt
tokens of admitted requests that have not produced their first token yet, i.e. prefill work
still queued (``--max-num-queued-tokens``). All bookkeeping runs on the event loop thread.
"""

from __future__ import annotations

from weir.server.errors import APIError


class AdmissionTicket:
    """One admitted request's share of the limits; give it back exactly once."""

    def __init__(self, control: "AdmissionControl", num_prompt_tokens: int):
        self._control = control
        self._waiting_tokens = num_prompt_tokens
        self._released = False

    def started(self) -> None:
        """The request produced output: its prompt is no longer queued prefill work."""
        self._control.num_waiting_tokens -= self._waiting_tokens
        self._waiting_tokens = 0

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.started()
        self._control.num_requests -= 1


class AdmissionControl:
    def __init__(self, max_num_queued_reqs: int, max_num_queued_tokens: int):
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.num_requests = 0
        self.num_waiting_tokens = 0
        self.num_rejected = 0

    def admit(self, num_prompt_tokens: int) -> AdmissionTicket:
        if self.num_requests + 1 > self.max_num_queued_reqs:
            self._reject(f"{self.num_requests} requests are in flight, the limit "
                         f"(--max-num-queued-reqs) is {self.max_num_queued_reqs}")
        # A prompt bigger than the whole token limit still runs when nothing else waits.
        if self.num_waiting_tokens and self.num_waiting_tokens + num_prompt_tokens > self.max_num_queued_tokens:
            self._reject(f"{self.num_waiting_tokens} prompt tokens are queued and this request adds "
                         f"{num_prompt_tokens}, the limit (--max-num-queued-tokens) is "
                         f"{self.max_num_queued_tokens}")
        self.num_requests += 1
        self.num_waiting_tokens += num_prompt_tokens
        return AdmissionTicket(self, num_prompt_tokens)

    def _reject(self, why: str) -> None:
        self.num_rejected += 1
        raise APIError(503, f"The server is overloaded: {why}; retry later", code="server_overloaded")
