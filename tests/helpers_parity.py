"""Judging a bf16 engine run against transformers in fp32, for the GPU end-to-end tests.

Greedy runs of a tiny random bf16 model part from fp32 at the first near-tie (a matched-count
ratio between two such runs is noise: Granite's GPU run kept 1 to 16 of 32 tokens). What a bug
cannot hide is a difference where fp32 prefers its token clearly, or logits farther from fp32
than bf16 puts them where the context is still fp32's (up to and including the first
difference). Both bounds are transformers' own bf16 error on the same prompts times ``SLACK``.

``truth`` and ``hf_bf16`` below are ``weir.testing.transformers_greedy`` results:
``[(tokens, logits [num_tokens, vocab] fp32)]``, one per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_harness import assert_greedy_parity, watch_engine
from weir.testing import transformers_greedy

# By the dtype of the engine's linear-attention states: 16-bit states round once more per step.
# Models without such states (MLA only) take the float32 entry.
SLACK = {"float32": 3.0, "bfloat16": 6.0}


def relative_error(ours: torch.Tensor, truth: torch.Tensor) -> float:
    truth = truth.to(ours.device)
    return ((ours.float() - truth).abs().max() / truth.abs().max()).item()


def identical_prefix(tokens: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def shared_positions(tokens: list[int], reference: list[int]) -> int:
    """How many leading positions saw fp32's context: through the first difference."""
    return min(identical_prefix(tokens, reference) + 1, len(reference))


def near_tie_margin(hf_bf16, truth, slack: float) -> float:
    """The fp32 logit margin under which bf16 rounding may swap the top two tokens: twice (both
    logits move) ``slack`` times transformers-bf16's largest logit error over the positions
    whose context was fp32's."""
    error = max((logits[:count] - reference_logits[:count]).abs().max().item()
                for (tokens, logits), (reference, reference_logits) in zip(hf_bf16, truth)
                for count in [shared_positions(tokens, reference)])
    return 2 * slack * error


def greedy_parity(token_lists: list[list[int]], truth, margin: float) -> tuple[list[int], list[str]]:
    """``assert_greedy_parity`` against fp32 for every prompt, all reported: the tokens identical
    per prompt, and one message per prompt that parted at a clear fp32 preference."""
    matched, failures = [], []
    for index, (tokens, (reference, reference_logits)) in enumerate(zip(token_lists, truth)):
        try:
            matched.append(assert_greedy_parity(tokens, reference, reference_logits, margin_tol=margin))
        except AssertionError as error:
            matched.append(identical_prefix(tokens, reference))
            failures.append(f"prompt {index}: {error}")
    return matched, failures


def assert_logits_near_fp32(watch, outputs, hf_bf16, truth, slack: float, mode: str) -> None:
    """At the positions both the engine's run and transformers-bf16's saw with fp32's context
    (prefill, and decodes up to the first difference), the engine's logits (``watch``: an eager
    engine's ``watch_engine``) are at most ``slack`` times transformers-bf16's largest relative
    error from fp32's, or 2e-2, whichever is larger."""
    counts = [min(shared_positions(hf_tokens, reference), shared_positions(output.outputs[0].token_ids, reference))
              for (hf_tokens, _), output, (reference, _) in zip(hf_bf16, outputs, truth)]
    weir_errors = [max(relative_error(watch.logits[o.request_id][j], reference_logits[j]) for j in range(count))
                   for o, (_, reference_logits), count in zip(outputs, truth, counts)]
    hf_errors = [max(relative_error(logits[j], reference_logits[j]) for j in range(count))
                 for (_, logits), (_, reference_logits), count in zip(hf_bf16, truth, counts)]
    bound = max(slack * max(hf_errors), 2e-2)
    report = (f"logits error against fp32 over the first {counts} positions per prompt: weir "
              f"{[f'{e:.1e}' for e in weir_errors]}, transformers bf16 {[f'{e:.1e}' for e in hf_errors]}")
    print(report)
    assert max(weir_errors) <= bound, f"weir bf16 ({mode}): {report}; bound {bound:.1e}"


# fp32 against fp32 on the GPU: the two differ by summation order alone (about 2e-6 relative on
# CPU runs), so only a near-exact tie of fp32's own top two may part their greedy tokens.
FP32_MARGIN = 1e-2


def assert_fp32_run(llm, prompts: list[list[int]], params, truth, mode: str) -> None:
    """An fp32 engine's greedy tokens part from ``truth`` (transformers fp32's) only where fp32's
    top-2 margin is under ``FP32_MARGIN``: the sharp check that bf16 runs of tiny random models
    cannot give (their near-tie margin exceeds every logit gap)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    matched, failures = greedy_parity([o.outputs[0].token_ids for o in outputs], truth, FP32_MARGIN)
    print(f"weir fp32 ({mode}): tokens identical to transformers fp32 per prompt {matched}")
    assert not failures, f"weir fp32 ({mode}) parts from transformers fp32 at a clear preference: {failures}"


@dataclass
class Fp32Reference:
    """transformers' greedy runs of a checkpoint in fp32 (``truth``) and bf16 on the GPU, and the
    near-tie margin they give; judges the engine's bf16 runs on the same prompts."""

    truth: list
    hf_bf16: list
    slack: float
    margin: float

    @classmethod
    def of(cls, path, prompts: list[list[int]], num_tokens: int, slack: float) -> Fp32Reference:
        truth = transformers_greedy(path, prompts, num_tokens, device="cuda", dtype="float32")
        hf_bf16 = transformers_greedy(path, prompts, num_tokens, device="cuda", dtype="bfloat16")
        return cls(truth, hf_bf16, slack, near_tie_margin(hf_bf16, truth, slack))

    @property
    def hf_matched(self) -> list[int]:
        """transformers-bf16's tokens identical to fp32's, per prompt."""
        return [identical_prefix(tokens, reference) for (tokens, _), (reference, _) in zip(self.hf_bf16, self.truth)]

    def assert_run(self, llm, prompts: list[list[int]], params, mode: str, eager: bool):
        """Generate ``prompts`` greedily: the tokens part from fp32's only at near-ties and (an
        eager engine: graph replays skip compute_logits) the logits stay near fp32's. Returns
        the outputs."""
        watch = watch_engine(llm) if eager else None
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        matched, failures = greedy_parity([o.outputs[0].token_ids for o in outputs], self.truth, self.margin)
        print(f"weir bf16 ({mode}): tokens identical to fp32 per prompt {matched}")
        assert not failures, (f"weir bf16 ({mode}) parts from fp32 where fp32 is no near-tie (margin "
                              f"{self.margin:.3g}): {failures}; identical tokens per prompt {matched}, "
                              f"transformers bf16's {self.hf_matched}")
        if eager:
            assert_logits_near_fp32(watch, outputs, self.hf_bf16, self.truth, self.slack, mode)
        return outputs

    def assert_chunked_follows(self, results: dict[str, list[list[int]]], cached: dict[str, list[int]]) -> None:
        """A "whole" and a "chunked" run's tokens (``results``) part from fp32's only at near-ties."""
        parity = {run: greedy_parity(tokens, self.truth, self.margin) for run, tokens in results.items()}
        matched = {run: counts for run, (counts, _) in parity.items()}
        report = (f"tokens identical to fp32 per prompt: {matched}, transformers bf16 {self.hf_matched}, chunked vs "
                  f"whole {[identical_prefix(a, b) for a, b in zip(results['chunked'], results['whole'])]}; "
                  f"cached tokens {cached}; near-tie margin {self.margin:.3g}")
        print(report)
        failures = {run: messages for run, (_, messages) in parity.items() if messages}
        assert not failures, f"{failures}; {report}"
