"""``draft_model``: a smaller Weir model with the target's vocabulary drafts autoregressively.

Its layers ride in the target's cache groups (``weir.spec_decode.draft_caches``), so its KV must
cover every position the target's does. After each target step, on the device:

1. a first pass over each request's step tokens plus one (positions ``s .. s + q`` for a
   request whose step started at ``s`` with ``q`` tokens), read back from the request table,
   which now holds the accepted drafts and the token sampled after them: the draft's KV is
   right up to the last known token, and its logits there give the first draft;
2. ``k - 1`` one-token passes feed each draft back in for the next.

Rows whose step did not sample (a partial prefill chunk) take part in the first pass with their
step tokens only. After a decode step that ran in a CUDA graph, the passes run in one of their own
(``weir.spec_decode.proposal_graphs``). Drafts are greedy (the
argmax of the draft's logits), which rejection sampling verifies as a one-hot draft distribution:
lossless for every request, sampled ones included, with no ``[batch, k, vocab]`` draft
probabilities to keep.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from weir.buffers import host_to_device
from weir.layers.moe import FusedExperts
from weir.runner.inputs import prepare_step_inputs
from weir.spec_decode.draft_caches import DraftCaches, step_starts
from weir.spec_decode.ngram import write_drafts
from weir.spec_decode.proposal_graphs import (one_token_passes, per_row, runs_in_a_graph, step_layout,
                                              write_graph_proposals)
from weir.weights import iter_checkpoint
from weir.weights.loader import load_model


class DraftModelProposer:
    runs_without_samples = True  # its KV of a prefill chunk is written by a pass in that step

    def __init__(self, runner, config):
        draft_config = runner.config.draft_model
        if draft_config is None:
            raise ValueError("speculative_config.method 'draft_model' needs speculative_config.model")
        model_cls = runner.resolve_model(draft_config.architecture)
        self.model = load_model(model_cls, draft_config, runner.device, iter_checkpoint(draft_config))
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        what = f"the draft model {draft_config.model!r}"
        self.caches = DraftCaches(runner, self.model, what)
        if runner.moe_backend is None and any(isinstance(m, FusedExperts) for m in self.model.modules()):
            runner.moe_backend = runner.choose_moe_backend()()
        self.runner = runner
        self.num_speculative_tokens = config.num_speculative_tokens
        # The draft passes write the KV of up to k positions past a step's last token.
        self.num_lookahead_tokens = config.num_speculative_tokens

    def propose(self, table, rows: torch.Tensor, max_len: int, plan, sampled: np.ndarray, graph_mode: str = "off",
                **_) -> None:
        if runs_in_a_graph(plan, sampled):
            write_graph_proposals(self.runner, table, rows, plan, graph_mode, partial(self._graph_passes, table))
            return
        runner = self.runner
        device, pin = runner.device, runner.pin_memory
        max_model_len = runner.max_model_len
        num_reqs = plan.num_reqs
        batch_rows = runner.inputs.idx_mapping[:num_reqs]
        starts = step_starts(runner, plan)  # [B]
        # First pass: every request's step tokens, as the table holds them now, and one more
        # for those that sampled (their first draft). A partial prefill chunk gets none: its
        # next position may lie in a block it does not hold yet.
        is_sampled = np.zeros(num_reqs, dtype=bool)
        is_sampled[sampled] = True
        lengths = plan.query_lens + is_sampled
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(lengths, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        start_of_row = torch.zeros_like(table.num_computed_tokens.gpu).index_copy_(0, batch_rows, starts.to(
            table.num_computed_tokens.gpu.dtype))
        qsl = host_to_device(query_start_loc.astype(np.int32), device, pin)
        input_ids, positions, seq_lens = prepare_step_inputs(table.token_ids.gpu, start_of_row, batch_rows, qsl,
                                                             num_tokens)
        ctx = self.caches.context(batch_rows, query_start_loc, positions, seq_lens, int(lengths.max()),
                                  plan.max_seq_len + 1)
        hidden = self.model(input_ids, positions.clamp_max(max_model_len - 1), ctx)  # [T + B, hidden]
        if sampled.size == 0:
            return  # prefill chunks only: their KV is all this step owes the draft
        # Logits at each sampled request's last known token (the one sampled this step).
        sampled_dev = host_to_device(sampled, device, pin)
        known = table.num_tokens.gpu[rows].long()  # [M], after this step's tokens
        last = host_to_device(query_start_loc[sampled], device, pin) + (known - 1 - starts[sampled_dev])
        draft = self.model.compute_logits(hidden[last]).argmax(dim=-1)  # [M]
        drafts = [draft]
        query_start_loc = np.arange(len(sampled) + 1, dtype=np.int64)
        for step in range(1, self.num_speculative_tokens):
            position = known - 1 + step  # the position of the draft fed in
            ctx = self.caches.context(rows, query_start_loc, position, position + 1, 1, max_len + step)
            hidden = self.model(draft, position.clamp_max(max_model_len - 1), ctx)
            draft = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(draft)
        write_drafts(table, rows, torch.stack(drafts, dim=1), torch.full_like(rows, self.num_speculative_tokens))

    def _graph_passes(self, table, size: int, width: int) -> torch.Tensor:
        """``propose``'s passes over a decode graph's padded batch, reading only persistent
        buffers (what a graph can replay): drafts ``[size, k]``, those of padding requests
        meaningless."""
        runner = self.runner
        max_model_len = runner.max_model_len
        rows, target_qsl, starts = step_layout(runner, size)  # [P], [P + 1], [P]
        # First pass: each request's step tokens and one more (all sampled), in width + 1 slots each.
        query_start_loc = target_qsl + torch.arange(size + 1, dtype=target_qsl.dtype, device=rows.device)
        num_tokens = size * (width + 1)
        input_ids, positions, seq_lens = prepare_step_inputs(table.token_ids.gpu, per_row(table, rows, starts), rows,
                                                             query_start_loc, num_tokens)
        ctx = self.caches.device_context(rows, query_start_loc, positions, seq_lens, width + 1, max_model_len,
                                         has_unowned_tokens=True)
        hidden = self.model(input_ids, positions.clamp_max(max_model_len - 1), ctx)  # [P * (width + 1), hidden]
        known = table.num_tokens.gpu[rows].long()  # [P], after this step's tokens
        last = (query_start_loc[:size].long() + known - 1 - starts).clamp(0, num_tokens - 1)
        draft = self.model.compute_logits(hidden[last]).argmax(dim=-1)  # [P]
        drafts = [draft]
        for _, position, ctx in one_token_passes(self.caches, rows, known - 1, self.num_speculative_tokens,
                                                 max_model_len):
            hidden = self.model(draft, position, ctx)
            draft = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)  # [P, k]
