"""``eagle``, ``eagle3`` and ``mtp``: a draft head fed the target's hidden states.

The head's pass at position ``p`` takes the token at ``p + 1`` and a hidden state of position
``p`` (the target's in the first pass, the head's own after it) and predicts the token at
``p + 2``. After each target step, on the device:

1. a first pass over the step's own positions, with the tokens shifted by one read back from the
   request table (which now holds the accepted drafts and the sampled token after them) and the
   target's hidden states of the step: the head's KV is right up to the last accepted position,
   and its logits there, next to the sampled token, give the first draft;
2. ``k - 1`` one-token passes, each feeding the previous draft and the head's own hidden state.

The head's layers ride in the target's cache groups (``weir.spec_decode.draft_caches``). After a
decode step that ran in a CUDA graph, the passes run in one of their own
(``weir.spec_decode.proposal_graphs``), reading the hidden states the step's graph gave. Drafts
are greedy, verified as one-hot draft distributions (lossless for sampled requests too).

Heads (their contract: ``weir.spec_decode.draft_head``): ``weir.spec_decode.eagle_heads``
(EAGLE and EAGLE-3 checkpoints in the layout vLLM loads), and for ``mtp`` the class the target
model names as ``mtp_head_class``, loaded from the target's checkpoint names that its
``checkpoint_pattern(hf_config)`` matches: Qwen3-Next's ``mtp.*`` block, DeepSeek-V3's and
V3.2's next-token modules at layer index ``num_hidden_layers`` on.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial

import numpy as np
import torch

from weir.buffers import host_to_device
from weir.runner.inputs import prepare_step_inputs
from weir.spec_decode.draft_caches import DraftCaches, step_starts
from weir.spec_decode.ngram import write_drafts
from weir.spec_decode.proposal_graphs import (one_token_passes, per_row, runs_in_a_graph, step_layout,
                                              write_graph_proposals)
from weir.weights import iter_checkpoint
from weir.weights.loader import load_model


def _load_head(runner, config):
    """The draft head, loaded and bound to the target's shared modules."""
    if config.method == "mtp":
        target_cls = type(runner.model)
        head_cls = getattr(target_cls, "mtp_head_class", None)
        if head_cls is None:
            raise ValueError(f"speculative_config.method 'mtp': {target_cls.__name__} has no multi-token-prediction "
                             f"head (its model class names none as mtp_head_class)")
        model_config = runner.config.model
        pattern = re.compile(head_cls.checkpoint_pattern(model_config.hf_config))
        weights = ((name, tensor) for name, tensor in iter_checkpoint(model_config) if pattern.match(name))
        what = f"the MTP head of {model_config.model!r}"
    else:
        from weir.spec_decode.eagle_heads import eagle_head_class

        model_config = runner.config.draft_model
        head_cls, model_config = eagle_head_class(config.method, model_config)
        weights = ((name.removeprefix("model."), tensor) for name, tensor in iter_checkpoint(model_config))
        what = f"the {config.method} head {model_config.model!r}"
    try:
        head = load_model(head_cls, model_config, runner.device, weights)
    except ValueError as error:
        raise ValueError(f"cannot load {what}: {error}") from error
    head.bind_target(runner.model)
    return head, what


class HiddenStateProposer:
    runs_without_samples = True  # its KV of a prefill chunk is written by a pass in that step

    def __init__(self, runner, config):
        self.runner = runner
        self.head, what = _load_head(runner, config)
        self.caches = DraftCaches(runner, self.head, what)
        self.num_speculative_tokens = config.num_speculative_tokens
        # The one-token passes write the KV of up to k - 1 positions past a step's last token.
        self.num_lookahead_tokens = config.num_speculative_tokens
        self.head.watch_target(runner.model)

    def propose(self, table, rows: torch.Tensor, max_len: int, plan, sampled: np.ndarray, graph_mode: str = "off",
                **_) -> None:
        if runs_in_a_graph(plan, sampled):
            write_graph_proposals(self.runner, table, rows, plan, graph_mode, partial(self._graph_passes, table))
            return
        runner, head = self.runner, self.head
        device, pin = runner.device, runner.pin_memory
        max_model_len = runner.max_model_len
        num_reqs, num_tokens = plan.num_reqs, plan.num_tokens
        batch_rows = runner.inputs.idx_mapping[:num_reqs]
        starts = step_starts(runner, plan)  # [B]
        query_start_loc = plan.query_start_loc[: num_reqs + 1].astype(np.int64)
        # First pass: the step's positions, each with the token after it.
        shifted_start = torch.zeros_like(table.num_computed_tokens.gpu).index_copy_(
            0, batch_rows, (starts + 1).to(table.num_computed_tokens.gpu.dtype))
        qsl = runner.inputs.query_start_loc[: num_reqs + 1]
        input_ids, _, _ = prepare_step_inputs(table.token_ids.gpu, shifted_start, batch_rows, qsl, num_tokens)
        positions = runner.inputs.positions[:num_tokens]
        ctx = self.caches.context(batch_rows, query_start_loc, positions, runner.inputs.seq_lens[:num_reqs],
                                  plan.max_query_len, plan.max_seq_len)
        logits_hidden, hidden = head(input_ids, positions, head.target_hidden(runner.last_hidden), ctx, 0)
        if sampled.size == 0:
            return  # prefill chunks only: their KV is all this step owes the head
        # Each sampled request's last accepted position: the one next to the token it sampled.
        sampled_dev = host_to_device(sampled, device, pin)
        known = table.num_tokens.gpu[rows].long()  # [M], after this step's tokens
        last = host_to_device(query_start_loc[sampled], device, pin) + (known - 2 - starts[sampled_dev])
        draft = head.draft_tokens(logits_hidden[last])  # [M]
        hidden = hidden[last]
        drafts = [draft]
        one_each = np.arange(len(sampled) + 1, dtype=np.int64)
        for step in range(1, self.num_speculative_tokens):
            position = known - 2 + step
            ctx = self.caches.context(rows, one_each, position, position + 1, 1, max_len + step)
            logits_hidden, hidden = head(draft, position.clamp_max(max_model_len - 1), hidden, ctx, step)
            draft = head.draft_tokens(logits_hidden)
            drafts.append(draft)
        write_drafts(table, rows, torch.stack(drafts, dim=1), torch.full_like(rows, self.num_speculative_tokens))

    def _graph_passes(self, table, size: int, width: int) -> torch.Tensor:
        """``propose``'s passes over a decode graph's padded batch, reading only persistent
        buffers and the step graph's hidden states: drafts ``[size, k]``, those of padding
        requests meaningless."""
        runner, head = self.runner, self.head
        max_model_len = runner.max_model_len
        rows, query_start_loc, starts = step_layout(runner, size)  # [P], [P + 1], [P]
        num_tokens = size * width
        input_ids, _, _ = prepare_step_inputs(table.token_ids.gpu, per_row(table, rows, starts + 1), rows,
                                              query_start_loc, num_tokens)
        positions = runner.inputs.positions[:num_tokens]
        ctx = self.caches.device_context(rows, query_start_loc, positions, runner.inputs.seq_lens[:size], width,
                                         max_model_len, has_unowned_tokens=True)
        logits_hidden, hidden = head(input_ids, positions, head.target_hidden(runner.last_hidden), ctx, 0)
        known = table.num_tokens.gpu[rows].long()  # [P], after this step's tokens
        last = (query_start_loc[:size].long() + known - 2 - starts).clamp(0, num_tokens - 1)
        draft = head.draft_tokens(logits_hidden[last])  # [P]
        hidden = hidden[last]
        drafts = [draft]
        for step, position, ctx in one_token_passes(self.caches, rows, known - 2, self.num_speculative_tokens,
                                                    max_model_len):
            logits_hidden, hidden = head(draft, position, hidden, ctx, step)
            draft = head.draft_tokens(logits_hidden)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)  # [P, k]


def with_hf_config(model_config, **attributes):
    """``model_config`` with a copy of its HF config carrying ``attributes`` (what a head's
    constructor reads, decided from the checkpoint before it is built)."""
    import copy

    hf_config = copy.copy(model_config.hf_config)
    for name, value in attributes.items():
        setattr(hf_config, name, value)
    return dataclasses.replace(model_config, hf_config=hf_config)
