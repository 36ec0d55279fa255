"""A draft network's passes as CUDA graphs record them (``weir.spec_decode.proposal_graphs``),
run on the CPU: every step takes the plan a graph would ("warm": decode and verification steps
padded to their graph's width, and with ``pad_batch`` to two more requests than they hold, as a
captured size pads them; the proposer's passes reading only the persistent buffers), and greedy
tokens stay those of the engine without speculation. A draft model equal to
the target must have every draft accepted, which holds only if the graph passes write the draft's
KV at the right positions and read the right last tokens."""

from __future__ import annotations

import pytest

from helpers_models import make_tiny_eagle
from test_spec_decode_engine import assert_same_completions, repetitive_prompts
from weir import LLM, SamplingParams
from weir.runner import model_runner
from weir.spec_decode import draft_model, eagle, proposal_graphs

pytestmark = pytest.mark.integration


def run_as_graphs_plan_it(path, prompts, params, speculative_config, monkeypatch, proposer_cls, pad_batch=False,
                          **options):
    """Generate with every step planned as its graph would be (``pad_batch``: two padding
    requests in each decode-graph batch), recording the (batch, width) of each run of the
    proposer's graph passes."""
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=speculative_config, **options)
    runner = llm.engine.runner
    execute = runner.execute
    runner.execute = lambda out, graph_mode="auto": execute(out, "warm")
    if pad_batch:
        plan_step = model_runner.plan_step

        def padded_plan(out, table, graph_size, *args):
            def padded(num_reqs, max_query_len):
                graph = graph_size(num_reqs, max_query_len)
                return None if graph is None else (graph[0] + 2, graph[1])
            return plan_step(out, table, padded, *args)

        monkeypatch.setattr(model_runner, "plan_step", padded_plan)
    shapes = []
    passes = proposer_cls._graph_passes

    def recorded(self, table, size, width):
        shapes.append((size, width))
        return passes(self, table, size, width)

    monkeypatch.setattr(proposer_cls, "_graph_passes", recorded)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs, shapes


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=16), dict(block_size=4, max_model_len=96),
                                     dict(pad_batch=True)],
                         ids=["plain", "chunked_prefill", "small_blocks", "padded_batch"])
def test_draft_model_graph_passes_accept_every_draft(tiny_llama_path, monkeypatch, options):
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    engine_options = {key: value for key, value in options.items() if key != "pad_batch"}
    want = LLM(str(tiny_llama_path), device="cpu", dtype="float32", **engine_options).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    speculative = {"method": "draft_model", "model": str(tiny_llama_path), "num_speculative_tokens": 3,
                   "adaptive": False}
    llm, got, shapes = run_as_graphs_plan_it(tiny_llama_path, prompts, params, speculative, monkeypatch,
                                             draft_model.DraftModelProposer,
                                             **options)
    assert_same_completions(got, want)
    counters = llm.engine.scheduler.spec.counters
    assert counters.num_draft_tokens > 0
    assert counters.num_accepted_tokens == counters.num_draft_tokens
    assert any(width == 4 for _, width in shapes)  # verification steps (width 1 + k) took the graph passes
    if options.get("pad_batch"):
        assert all(size >= 3 for size, _ in shapes)  # every run of the passes had padding requests


@pytest.mark.parametrize("pad_batch", [False, True], ids=["exact_batch", "padded_batch"])
def test_eagle_graph_passes_draft_what_the_eager_ones_draft(tiny_llama_path, tmp_path, monkeypatch, pad_batch):
    """A random head accepts almost nothing, so its drafts themselves are compared: every step's,
    from the graph passes and from the eager ones (the same schedule, as greedy tokens match)."""
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(str(tiny_llama_path), device="cpu", dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    head = make_tiny_eagle(tmp_path / "eagle3", tiny_llama_path, eagle3=True, aux_layers=[0, 1, 1])
    speculative = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    written = []
    write_drafts = eagle.write_drafts
    for module in (eagle, proposal_graphs):  # the eager passes' writes, and the graph passes'
        monkeypatch.setattr(module, "write_drafts", lambda table, rows, drafts, counts: (
            written.append(drafts.tolist()), write_drafts(table, rows, drafts, counts)))
    eager = LLM(str(tiny_llama_path), device="cpu", dtype="float32", speculative_config=speculative).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eager_drafts, written[:] = list(written), []
    _, got, shapes = run_as_graphs_plan_it(tiny_llama_path, prompts, params, speculative, monkeypatch,
                                           eagle.HiddenStateProposer, pad_batch=pad_batch)
    assert_same_completions(got, want)
    assert_same_completions(eager, want)
    assert any(width == 3 for _, width in shapes)
    assert written == eager_drafts
