"""Device-to-host copy of one step's results without stalling the step loop.

On an accelerator the copy runs on a side stream after the main stream's work, and only
``get()`` waits for it; the engine calls ``get()`` after it has already launched the next
step, so the host reads step N while the device runs step N+1.
"""

from __future__ import annotations

import torch

from weir.scheduler.scheduler import SampledTokens


class AsyncOutput:
    def __init__(self, req_ids: list[str], sampled: torch.Tensor, logprob_ids: torch.Tensor | None,
                 logprobs: torch.Tensor | None, ranks: torch.Tensor | None,
                 copy_stream: "torch.cuda.Stream | None"):
        self.req_ids = req_ids
        tensors = [t for t in (sampled, logprob_ids, logprobs, ranks)]
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
        sampled, logprob_ids, logprobs, ranks = self._host
        return SampledTokens(
            req_ids=self.req_ids,
            sampled_token_ids=sampled.tolist(),
            logprob_token_ids=None if logprob_ids is None else logprob_ids.tolist(),
            logprobs=None if logprobs is None else logprobs.tolist(),
            logprob_ranks=None if ranks is None else ranks.tolist(),
        )


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
