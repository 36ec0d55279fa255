"""The model runner's side of speculative decoding: one step's logits rows, verification, the
post-update by accepted counts, and proposing the next step's drafts, all on the device.

Every step of a speculative engine samples through the verifier (a step without drafts is
sampling at one row per request), so ``min_tokens`` holds by the device's exact output counts
even while the host's counts are optimistic. After the post-update, each request that sampled
gets drafts for its next step from the proposer, written into the request table right after its
known tokens: the next step's input gathering reads them from there like any other token.
"""

from __future__ import annotations

import numpy as np
import torch

from weir.buffers import host_to_device
from weir.runner.async_output import AsyncOutput
from weir.runner.input_buffers import StepPlan
from weir.runner.inputs import post_update
from weir.scheduler.output import SchedulerOutput
from weir.scheduler.scheduler import SampledTokens
from weir.spec_decode.config import SpeculativeConfig
from weir.spec_decode.linear_state import StateRollback
from weir.spec_decode.verify import Verifier, VerifyLayout, verify_layout


def make_proposer(runner, config: SpeculativeConfig):
    """The method's proposer: ``num_lookahead_tokens`` (KV slots it writes past a step's tokens),
    ``runs_without_samples`` (whether a step that sampled nothing still needs its pass) and
    ``propose(table, rows, max_len, ...)``."""
    if config.method == "ngram":
        from weir.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from weir.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(runner, config)
    if config.method in ("eagle", "eagle3", "mtp"):
        from weir.spec_decode.eagle import HiddenStateProposer

        return HiddenStateProposer(runner, config)
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer")


class SpecDecodeStep:
    def __init__(self, runner, config: SpeculativeConfig):
        self.runner = runner
        self.config = config
        self.verifier = Verifier(runner.sampler)
        # Linear-attention layers verify on a scratch state; the accepted tokens move the slots on.
        self.rollback = (StateRollback(runner, config.num_speculative_tokens) if runner.caches.state_layers
                         else None)
        self.proposer = make_proposer(runner, config)

    def extra_kv_bytes_per_block(self, group: int) -> int:
        caches = getattr(self.proposer, "caches", None)
        return caches.extra_bytes_per_block(group) if caches is not None else 0

    def allocate_kv_caches(self, num_blocks: list[int]) -> None:
        caches = getattr(self.proposer, "caches", None)
        if caches is not None:
            caches.allocate(num_blocks)

    def graph_extras(self) -> dict:
        """What a draft head keeps of the target's forward besides the hidden states (EAGLE-3's
        residual streams), as a captured graph's outputs."""
        head = getattr(self.proposer, "head", None)
        return dict(getattr(head, "_aux", {}) or {})

    def restore_graph_extras(self, extras: dict) -> None:
        head = getattr(self.proposer, "head", None)
        if extras and head is not None:
            head._aux = dict(extras)

    def layout(self, plan: StepPlan) -> VerifyLayout:
        runner = self.runner
        num_reqs = plan.num_reqs
        layout = verify_layout(plan.query_start_loc[: num_reqs + 1], plan.num_drafts, runner.device,
                               runner.pin_memory)
        plan.logits_indices = layout.device["logits_indices"]
        return layout

    def prepare(self, plan: StepPlan) -> None:
        """After the step's inputs are on the device, before its forward."""
        if self.rollback is not None:
            self.rollback.prepare(plan)

    def finish_step(self, plan: StepPlan, logits: torch.Tensor, layout: VerifyLayout,
                    out: SchedulerOutput, graph_mode: str = "off") -> AsyncOutput:
        """Verify, post-update, propose; the step's results on their way to the host.
        ``graph_mode`` is the step's: a draft network's passes after a graph step take it."""
        runner, table, buffers = self.runner, self.runner.table, self.runner.inputs
        num_reqs, num_tokens = plan.num_reqs, plan.num_tokens
        real_rows = buffers.idx_mapping[:num_reqs]
        input_ids, positions = buffers.input_ids[:num_tokens], buffers.positions[:num_tokens]
        result = self.verifier.verify(logits, layout, real_rows, plan.rows, input_ids, positions, table.num_tokens.gpu,
                                      table.num_prompt_tokens.gpu, table.num_drafts.gpu)
        if self.rollback is not None:
            self.rollback.commit(result.num_rejected)
        query_start_loc = buffers.query_start_loc
        post_update(table.token_ids.gpu, table.num_tokens.gpu, table.num_computed_tokens.gpu,
                    runner.sampler.output_token_counts, real_rows,
                    query_start_loc[1: num_reqs + 1] - query_start_loc[:num_reqs], result.token_ids,
                    result.num_emitted, result.num_rejected)
        # Known tokens after this step, at most: every draft accepted, and one token sampled after them.
        max_known = int((table.num_computed_host[plan.rows] + plan.query_lens).max()) + 1
        table.num_computed_host[plan.rows] += plan.query_lens  # corrected when the result is read
        sampled = [index for index, req_id in enumerate(plan.req_ids) if req_id in out.sampling_req_ids]
        # A draft network runs even when nothing sampled (only prefill chunks): its first pass
        # writes its KV of the chunks, which every later draft of those requests attends to.
        if sampled or self.proposer.runs_without_samples:
            rows = host_to_device(plan.rows[sampled], runner.device, runner.pin_memory)
            self.proposer.propose(table, rows, max_known, plan=plan, layout=layout, result=result,
                                  sampled=np.asarray(sampled, dtype=np.int64), graph_mode=graph_mode)
        return AsyncOutput(plan.req_ids, result.token_ids, result.logprob_token_ids, result.logprobs, result.ranks,
                           runner.copy_stream, result.num_emitted, result.num_verified,
                           on_host=self._mirror_correction(plan))

    def _mirror_correction(self, plan: StepPlan):
        """Take each verifying row's rejected drafts out of the host mirror once they are known,
        unless the row went to another request meanwhile."""
        table = self.table_ref()
        rows, num_drafts = plan.rows.copy(), plan.num_drafts.copy()
        epochs = table.row_epoch[rows].copy()
        if not num_drafts.any():
            return None

        def correct(result: SampledTokens) -> None:
            for batch_idx, (row, drafts, epoch) in enumerate(zip(rows, num_drafts, epochs)):
                if drafts and table.row_epoch[row] == epoch:
                    accepted = len(result.spec_token_ids[batch_idx]) - 1
                    table.num_computed_host[row] -= drafts - accepted

        return correct

    def table_ref(self):
        return self.runner.table
