"""Speculative decoding through the whole engine on tiny random checkpoints: greedy tokens and
their logprobs equal to the same engine without speculation, through chunked prefill, prefix-cache
hits and preemption, with and without async scheduling; seeded sampling that does not depend on
the batch; min_tokens and stop strings inside accepted runs; the acceptance counts."""

from __future__ import annotations

import random

import pytest

from engine_harness import assert_nothing_held
from helpers_models import make_tiny_llama, make_tiny_qwen3
from test_engine_parity import kv_bytes_for_blocks
from weir import LLM, SamplingParams

pytestmark = pytest.mark.integration

NUM_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAKERS = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def checkpoint(request, tmp_path_factory):
    return MAKERS[request.param](tmp_path_factory.mktemp(request.param), with_tokenizer=True)


def repetitive_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (drafts get accepted) and plain random ones."""
    rng = random.Random(seed)
    prompts = []
    for length in (3, 9, 17, 24, 31, 40, 55, 70):
        phrase = [rng.randrange(0, 256) for _ in range(rng.randrange(2, 6))]
        if length % 2:
            prompts.append((phrase * 40)[:length])
        else:
            prompts.append([rng.randrange(0, 256) for _ in range(length)])
    return prompts


def shared_prefix_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(0, 256) for _ in range(5)] * 8
    return [prefix[: 16 + 3 * i] + [rng.randrange(0, 256) for _ in range(1 + i)] for i in range(8)]


SCENARIOS = {
    "chunked_prefill": (dict(max_num_batched_tokens=16), repetitive_prompts),
    "prefix_cache": (dict(block_size=4), shared_prefix_prompts),
    "preemption": (dict(block_size=4, max_model_len=128), repetitive_prompts),
}


def generate(path, prompts, params, speculative_config=None, **options):
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=speculative_config, **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


def assert_same_completions(got, want, check_logprobs: bool = True):
    for output, expected in zip(got, want):
        a, b = output.outputs[0], expected.outputs[0]
        assert a.token_ids == b.token_ids, output.request_id
        assert a.finish_reason == b.finish_reason
        if check_logprobs and b.logprobs is not None:
            assert len(a.logprobs) == len(b.logprobs)
            for mine, theirs in zip(a.logprobs, b.logprobs):
                assert list(mine) == list(theirs)  # the same ids, in the same order
                for token_id, logprob in theirs.items():
                    assert mine[token_id].rank == logprob.rank
                    assert mine[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equals_no_speculation(checkpoint, scenario, async_scheduling, method):
    """``draft_model`` drafts with the target's own checkpoint: every draft must be accepted, which
    holds only if the draft's KV is right at every position (chunks, prefix hits, recompute)."""
    options, make_prompts = SCENARIOS[scenario]
    options = dict(options, async_scheduling=async_scheduling)
    if scenario == "preemption":
        options["kv_cache_memory_bytes"] = kv_bytes_for_blocks(checkpoint, 41, 4)
    prompts = make_prompts()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    _, want = generate(checkpoint, prompts, params, **options)
    speculative = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(checkpoint),
                                                    "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model" and scenario == "preemption":
        # The draft's layers share each block: the same bytes hold half the blocks.
        options["kv_cache_memory_bytes"] *= 2
    llm, got = generate(checkpoint, prompts, params, speculative, **options)
    assert_same_completions(got, want)
    scheduler = llm.engine.scheduler
    if scenario == "preemption":
        assert scheduler.num_preemptions > 0
    if scenario == "prefix_cache":
        assert scheduler.kv_cache.num_prefix_hits > 0
    counters = scheduler.spec.counters
    assert counters.num_accepted_tokens > 0  # the repeated phrases were drafted and accepted
    if method == "draft_model":
        assert counters.num_accepted_tokens == counters.num_draft_tokens
    accepted = sum(o.outputs[0].spec_decode_metrics.num_accepted_draft_tokens for o in got)
    assert accepted == counters.num_accepted_tokens
    assert_nothing_held(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_draft_kv_is_written_in_steps_where_nothing_samples(tiny_llama_path, async_scheduling):
    """A lone prompt longer than the token budget: its first chunks' steps sample nothing, and the
    draft (the target's own checkpoint) must still compute its KV there, or every draft after
    the prompt attends to unwritten entries and is rejected."""
    prompt = [random.Random(5).randrange(0, 256) for _ in range(70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    _, want = generate(tiny_llama_path, [prompt], params, **options)
    speculative = {"method": "draft_model", "model": str(tiny_llama_path), "num_speculative_tokens": 3,
                   "adaptive": False}
    llm, got = generate(tiny_llama_path, [prompt], params, speculative, **options)
    assert_same_completions(got, want)
    counters = llm.engine.scheduler.spec.counters
    assert counters.num_draft_tokens > 0
    assert counters.num_accepted_tokens == counters.num_draft_tokens
    assert_nothing_held(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_draft_model_runs_up_to_max_model_len(tiny_llama_path, async_scheduling):
    """The draft passes after the last steps write positions past max_model_len (past the block
    table's columns): those slots are dropped, the request ends for length as without drafts."""
    prompt = ([11, 12, 13, 14, 15] * 10)[:40]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    options = dict(max_model_len=64, block_size=16, async_scheduling=async_scheduling)
    _, want = generate(tiny_llama_path, [prompt], params, **options)
    speculative = {"method": "draft_model", "model": str(tiny_llama_path), "num_speculative_tokens": 3,
                   "adaptive": False}
    llm, got = generate(tiny_llama_path, [prompt], params, speculative, **options)
    assert_same_completions(got, want)
    assert len(got[0].outputs[0].token_ids) == 64 - len(prompt)
    assert got[0].outputs[0].finish_reason == "length"
    assert_nothing_held(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llama_path, async_scheduling):
    prompts = repetitive_prompts(3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=100 + i, max_tokens=NUM_TOKENS,
                             ignore_eos=True, logprobs=2, repetition_penalty=1.1, presence_penalty=0.2)
              for i in range(len(prompts))]
    llm = LLM(str(tiny_llama_path), device="cpu", speculative_config=NGRAM, async_scheduling=async_scheduling)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for index in (0, 5):
        alone = llm.generate([{"prompt_token_ids": prompts[index]}], params[index], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == together[index].outputs[0].token_ids
    assert llm.engine.scheduler.spec.counters.num_draft_tokens > 0
    assert_nothing_held(llm)


def test_seeded_sampling_gives_the_tokens_of_sampling_without_drafts(tiny_llama_path):
    """A seeded sampled request emits the tokens plain sampling gives, however many drafts each
    step verified: with n-gram drafts at the default token budget and at an 8-token one, where
    what else a step holds decides how many drafts fit."""
    prompts = repetitive_prompts(4)
    params = [SamplingParams(temperature=0.3, top_k=20, seed=200 + i, max_tokens=NUM_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(tiny_llama_path), device="cpu").generate(inputs, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in plain]
    for options in ({}, {"max_num_batched_tokens": 8, "max_num_seqs": 2}):
        llm = LLM(str(tiny_llama_path), device="cpu", speculative_config=NGRAM, **options)
        got = llm.generate(inputs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want, options
        counters = llm.engine.scheduler.spec.counters
        assert counters.num_accepted_tokens > 0, options  # drafts were taken, not just offered
        assert_nothing_held(llm)


def test_min_tokens_and_stop_inside_accepted_runs(tiny_llama_path):
    prompt = [7, 8, 9] * 12
    base = LLM(str(tiny_llama_path), device="cpu")
    greedy = base.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=30,
                                                                          ignore_eos=True), use_tqdm=False)
    tokens = greedy[0].outputs[0].token_ids
    spec = LLM(str(tiny_llama_path), device="cpu", speculative_config=NGRAM)
    # The 6th greedy token as a stop token id: the completion ends right there.
    stop_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[tokens[5]])
    want = base.generate([{"prompt_token_ids": prompt}], stop_params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": prompt}], stop_params, use_tqdm=False)
    assert_same_completions(got, want)
    # min_tokens bans it before then, on the device: the same tokens as without drafts.
    min_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[tokens[5]],
                                min_tokens=12)
    want = base.generate([{"prompt_token_ids": prompt}], min_params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": prompt}], min_params, use_tqdm=False)
    assert_same_completions(got, want)
    assert len(got[0].outputs[0].token_ids) >= 12
    # A stop string inside an accepted run drops what follows it.
    text = base.get_tokenizer().decode(tokens[4:7])
    if text.strip():
        stop_text = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text])
        want = base.generate([{"prompt_token_ids": prompt}], stop_text, use_tqdm=False)
        got = spec.generate([{"prompt_token_ids": prompt}], stop_text, use_tqdm=False)
        assert got[0].outputs[0].text == want[0].outputs[0].text
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        assert got[0].outputs[0].finish_reason == "stop"
    assert spec.engine.scheduler.spec.counters.num_accepted_tokens > 0
    assert_nothing_held(spec)


def test_acceptance_counts_on_request_outputs(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), device="cpu", speculative_config=dict(NGRAM, adaptive=False),
              per_request_spec_decode_metrics="detailed")
    out = llm.generate([{"prompt_token_ids": [4, 5, 6, 7] * 10}], SamplingParams(temperature=0, max_tokens=40,
                                                                                  ignore_eos=True), use_tqdm=False)
    stats = out[0].outputs[0].spec_decode_metrics
    body = stats.to_dict(detailed=True)
    assert body["num_spec_steps"] == len(body["per_step_accepted"]) == sum(body["acceptance_histogram"]) > 0
    assert body["num_accepted_draft_tokens"] == sum(body["per_step_accepted"])
    assert body["num_draft_tokens"] == sum(body["per_step_drafted"])
    assert all(0 <= a <= d <= 3 for a, d in zip(body["per_step_accepted"], body["per_step_drafted"]))
    # Every emitted token came from a spec step or from a plain one (the first, after the prompt).
    emitted_by_spec = body["num_spec_steps"] + body["num_accepted_draft_tokens"]
    assert emitted_by_spec <= 40


PARAGRAPH = ("The river runs through the old town, past the mill and the market square, under seven stone bridges, "
             "and out into the fields where the herons wait in the reeds for the morning light.")


def test_default_model_with_ngram_repeats_a_paragraph_as_without():
    """The real SmolLM2 (its GGUF): the same greedy text, and drafts the stats say were accepted."""
    messages = [[{"role": "user", "content": f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}"}]]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = LLM(device="cpu", max_model_len=1024).chat(messages, params, use_tqdm=False)
    spec = LLM(device="cpu", max_model_len=1024, per_request_spec_decode_metrics="summary",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 2})
    got = spec.chat(messages, params, use_tqdm=False)
    assert got[0].outputs[0].text == want[0].outputs[0].text
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert "seven stone bridges" in got[0].outputs[0].text
    stats = got[0].outputs[0].spec_decode_metrics
    assert stats.draft_acceptance_rate > 0 and stats.mean_acceptance_length > 1.5
    assert_nothing_held(spec)


class OracleProposer:
    """Drafts the baseline's own next tokens, with every ``corrupt_every``-th draft position of
    a row replaced by a wrong token: verification then accepts runs of every length, which
    n-grams over a random model rarely give. Reads the device (a test may)."""

    num_lookahead_tokens = 0
    runs_without_samples = False

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], num_drafts: int, corrupt_every: int = 4):
        self.continuations = continuations
        self.num_drafts = num_drafts
        self.corrupt_every = corrupt_every
        self.calls = 0

    def propose(self, table, rows, max_len, **_):
        from weir.spec_decode.ngram import write_drafts

        import torch

        drafts = torch.zeros(rows.shape[0], self.num_drafts, dtype=torch.long)
        for index, row in enumerate(rows.tolist()):
            num_prompt = int(table.num_prompt_tokens.gpu[row])
            known = int(table.num_tokens.gpu[row])
            prompt = tuple(table.token_ids.gpu[row, :num_prompt].tolist())
            future = self.continuations[prompt][known - num_prompt:]
            for j in range(self.num_drafts):
                self.calls += 1
                right = future[j] if j < len(future) else 0
                drafts[index, j] = (right + 1) % 256 if self.calls % self.corrupt_every == 0 else right
        write_drafts(table, rows, drafts.to(rows.device), torch.full_like(rows, self.num_drafts))


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory):
    from helpers_models import make_tiny_qwen3_next

    return make_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3_next"), with_tokenizer=True)


@pytest.fixture(scope="module")
def tiny_kimi_linear(tmp_path_factory):
    from helpers_models import make_tiny_kimi_linear

    return make_tiny_kimi_linear(tmp_path_factory.mktemp("kimi_linear"), with_tokenizer=True)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("model", ["llama", "qwen3_next", "kimi_linear"])
def test_partially_accepted_drafts_keep_greedy_and_logprobs_exact(request, model, async_scheduling):
    """Runs of every accepted length; for Qwen3-Next (Gated DeltaNet) and Kimi Linear (KDA) also
    that the linear-attention state keeps nothing of rejected drafts (a wrong state would change
    every later token)."""
    path = request.getfixturevalue({"llama": "tiny_llama_path", "qwen3_next": "tiny_qwen3_next",
                                    "kimi_linear": "tiny_kimi_linear"}[model])
    prompts = repetitive_prompts(7)[:6]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    options = dict(max_num_batched_tokens=24, block_size=4, async_scheduling=async_scheduling)
    _, want = generate(path, prompts, params, **options)
    continuations = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want)}
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=dict(NGRAM, adaptive=False), **options)
    llm.engine.runner.spec.proposer = OracleProposer(continuations, 3)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_same_completions(got, want)
    histogram = [0] * 4
    for output in got:
        for j, count in enumerate(output.outputs[0].spec_decode_metrics.acceptance_histogram):
            histogram[j] += count
    assert all(count > 0 for count in histogram), histogram  # rejected at every draft, or none
    assert_nothing_held(llm)


@pytest.mark.parametrize("model", ["qwen3_next", "kimi_linear"])
def test_linear_attention_verify_graph_path_keeps_greedy_exact(request, model):
    """Every step planned as its own graph would be ("warm": the graph's plan, run eagerly), so
    verify steps take the graph path on the CPU: every row per position on the scratch state,
    indices built on the device, the accepted tokens committed after; and steps of short chunks
    without drafts are planned without the verify width (they would pay the scratch path for
    nothing)."""
    path = request.getfixturevalue({"qwen3_next": "tiny_qwen3_next", "kimi_linear": "tiny_kimi_linear"}[model])
    prompts = repetitive_prompts(7)[:6]
    alone = [random.Random(3).randrange(256) for _ in range(27)]  # run by itself: chunks of 24 and 3 tokens
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    options = dict(max_num_batched_tokens=24, block_size=4)
    _, want = generate(path, prompts + [alone], params, **options)
    continuations = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts + [alone], want)}
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=dict(NGRAM, adaptive=False), **options)
    runner = llm.engine.runner
    runner.spec.proposer = OracleProposer(continuations, 3)
    execute, plan_step, widths = runner.execute, runner._plan, []

    def plan(out, graph_mode):
        step = plan_step(out, graph_mode)
        has_drafts = any(out.num_draft_tokens.values())
        widths.append((step.graph_width if step.graph_size is not None else None, has_drafts, step.max_query_len))
        return step

    runner._plan = plan
    runner.execute = lambda out, graph_mode="auto": execute(out, "warm")
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got += llm.generate([{"prompt_token_ids": alone}], params, use_tqdm=False)
    assert_same_completions(got, want)
    assert (4, True, 4) in widths  # verify steps ran the width-4 graph path
    assert (None, False, 3) in widths  # the 3-token chunk without drafts: no verify width, eager
    assert all(width in (1, None) for width, has_drafts, _ in widths if not has_drafts)
    assert_nothing_held(llm)


def test_a_checkpoint_saved_in_a_verify_graph_holds_the_committed_state(tiny_qwen3_next):
    """A prefill chunk of at most ``1 + k`` tokens beside a verifying request runs in the verify
    graph's plan (every row on the scratch state, the slots moved on at commit): a state
    checkpoint at the chunk's end must be saved after the commit, or it holds the chunk's start
    and the prompt resuming from it gets other tokens. Budget 66 and a 5-token neighbour put the
    104-token prompt's chunk 61-64 (64: its junction with the first prompt) beside the neighbour's
    first verify step; steps are planned as their graphs would be ("warm") on the CPU."""
    rng = random.Random(11)
    base = [rng.randrange(256) for _ in range(150)]
    junction = base[:64] + [rng.randrange(256) for _ in range(40)]
    resumes = base[:64] + [rng.randrange(256) for _ in range(30)]
    neighbour = [rng.randrange(256) for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)

    def run(**options):
        llm = LLM(str(tiny_qwen3_next), device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=66,
                  **options)
        runner, planned = llm.engine.runner, []
        execute, plan_step = runner.execute, runner._plan

        def plan(out, graph_mode):
            step = plan_step(out, graph_mode)
            planned.append((step.graph_width if step.graph_size is not None else 1, sorted(step.query_lens)))
            return step

        runner._plan = plan
        runner.execute = lambda out, graph_mode="auto": execute(out, "warm")
        outputs = [llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                   for batch in ([base], [neighbour, junction], [resumes])]
        assert_nothing_held(llm)
        return [o for batch in outputs for o in batch], planned

    want, _ = run(enable_prefix_caching=False)
    got, planned = run(enable_prefix_caching=True, speculative_config=dict(NGRAM, adaptive=False))
    assert (4, [3, 4]) in planned  # the junction's 3-token chunk beside the neighbour's 1 + 3
    assert got[-1].num_cached_tokens == 64  # resumed from the checkpoint saved in that step
    assert_same_completions(got, want, check_logprobs=False)


@pytest.fixture(scope="module")
def tiny_granite_swa(tmp_path_factory):
    from helpers_models import make_tiny_granite_swa

    return make_tiny_granite_swa(tmp_path_factory.mktemp("granite_swa"), with_tokenizer=True)


def test_windows_keep_the_blocks_of_drafts_still_being_verified(tiny_granite_swa):
    """Async scheduling plans a step while the last one's drafts are verified on the device, and
    counts them as accepted: a sliding window must not free the blocks before the window of that
    count, which the device's query (at the accepted count) still reads. Every draft is wrong
    here, and the blocks are few, so a freed block goes to another request at once."""
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    options = dict(block_size=4, async_scheduling=True, enable_prefix_caching=False, max_model_len=128,
                   kv_cache_memory_bytes=200_000)
    _, want = generate(tiny_granite_swa, prompts, params, **options)
    continuations = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want)}
    llm = LLM(str(tiny_granite_swa), device="cpu", dtype="float32", speculative_config=dict(NGRAM, adaptive=False),
              **options)
    llm.engine.runner.spec.proposer = OracleProposer(continuations, 3, corrupt_every=1)
    kv_cache, table = llm.engine.scheduler.kv_cache, llm.engine.runner.table
    windows = [group.sliding_window for group in kv_cache.groups]
    assert any(windows)
    freed_too_early = []
    free_out_of_window = kv_cache._free_out_of_window

    def checked(held, next_position):
        # The device has run every step before the one being planned (the CPU runs them whole).
        for req_id, blocks in kv_cache._requests.items():
            if blocks is held and req_id in table.row_of:
                device_position = int(table.num_computed_tokens.gpu[table.row_of[req_id]])
                for window in filter(None, windows):
                    if max(0, next_position - window + 1) // 4 > max(0, device_position - window + 1) // 4:
                        freed_too_early.append((req_id, next_position, device_position))
        free_out_of_window(held, next_position)

    kv_cache._free_out_of_window = checked
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert not freed_too_early, freed_too_early[:5]
    assert_same_completions(got, want)
    assert llm.engine.scheduler.spec.counters.num_draft_tokens > 0
    assert_nothing_held(llm)


def test_a_different_draft_model_keeps_greedy_exact(tiny_llama_path, tmp_path):
    draft = make_tiny_llama(tmp_path / "draft", seed=3, num_hidden_layers=1)
    prompts = repetitive_prompts(11)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    _, want = generate(tiny_llama_path, prompts, params, max_num_batched_tokens=32)
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm, got = generate(tiny_llama_path, prompts, params, speculative, max_num_batched_tokens=32)
    assert_same_completions(got, want)
    assert llm.engine.scheduler.spec.counters.num_draft_tokens > 0
    assert_nothing_held(llm)


def test_a_draft_with_linear_attention_is_refused(tiny_llama_path, tiny_qwen3_next):
    with pytest.raises(ValueError, match="linear-attention layers"):
        LLM(str(tiny_llama_path), device="cpu", speculative_config={
            "method": "draft_model", "model": str(tiny_qwen3_next), "num_speculative_tokens": 2})
