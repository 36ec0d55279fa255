"""Device-to-host copy of one step's results without stalling the step loop.

On an accelerator the copy runs on a side stream after the main stream's work, and only
``get()`` waits for it; the engine calls ``get()`` after it has already launched the next
step, so the host reads step N while the device runs step N+1.

A speculative step (``spec=True``) brings back each request's emitted tokens ``[B, S]`` with
their count and the drafts it verified; ``on_host`` then sees the result first (the runner
corrects its host mirror of computed tokens by the rejected drafts, a step late).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weir.scheduler.scheduler import SampledTokens


class AsyncOutput:
    def __init__(self, req_ids: list[str], sampled: torch.Tensor, logprob_ids: torch.Tensor | None,
                 logprobs: torch.Tensor | None, ranks: torch.Tensor | None,
                 copy_stream: "torch.cuda.Stream | None", num_emitted: torch.Tensor | None = None,
                 num_verified: torch.Tensor | None = None,
                 on_host: Callable[[SampledTokens], None] | None = None):
        self.req_ids = req_ids
        self.spec = num_emitted is not None
        self.on_host = on_host
        tensors = [sampled, logprob_ids, logprobs, ranks, num_emitted, num_verified]
        self._event = None
        if copy_stream is None:
            self._host = tensors
            return
        main_stream = torch.cuda.current_stream(sampled.device)
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main_stream)
            self._host = [None if t is None else _pinned_copy(t) for t in tensors]
            for t in tensors:
                if t is not None:
                    t.record_stream(copy_stream)  # keep the device memory until the copy ends
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)

    def get(self) -> SampledTokens:
        if self._event is not None:
            self._event.synchronize()
        sampled, logprob_ids, logprobs, ranks, num_emitted, num_verified = self._host

        def as_list(tensor):
            return None if tensor is None else tensor.tolist()

        if not self.spec:
            return SampledTokens(req_ids=self.req_ids, sampled_token_ids=sampled.tolist(),
                                 logprob_token_ids=as_list(logprob_ids), logprobs=as_list(logprobs),
                                 logprob_ranks=as_list(ranks))
        counts = num_emitted.tolist()
        result = SampledTokens(
            req_ids=self.req_ids, sampled_token_ids=None,
            spec_token_ids=[row[:count] for row, count in zip(sampled.tolist(), counts)],
            num_verified_drafts=num_verified.tolist(), logprob_token_ids=as_list(logprob_ids),
            logprobs=as_list(logprobs), logprob_ranks=as_list(ranks))
        if self.on_host is not None:
            self.on_host(result)
        return result


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
