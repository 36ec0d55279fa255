"""Speculative decoding's parts alone: speculative_config's checks, the adaptive rule, the stats
arithmetic, the n-gram proposer, rejection sampling (exact for greedy rows, the target's
distribution for random ones by a chi-square bound the draft's distribution fails), the
post-update by accepted counts, and the scheduler's drafts within the token budget."""

from __future__ import annotations

import json

import pytest
import torch

from test_scheduler import FakeKVCache
from weir.config import SchedulerConfig
from weir.request import Request, RequestStatus
from weir.runner import inputs
from weir.sampling_params import SamplingParams
from weir.scheduler import Scheduler
from weir.scheduler.scheduler import SampledTokens
from weir.spec_decode.adaptive import AdaptiveDrafts, best_num_drafts
from weir.spec_decode.config import SpeculativeConfig
from weir.spec_decode.ngram import propose_ngram
from weir.spec_decode.rejection import rejection_sample
from weir.spec_decode.scheduling import SpecScheduling
from weir.spec_decode.stats import RequestSpecStats, SpecDecodeCounters

# ---- speculative_config ------------------------------------------------------------------


def test_config_defaults_and_aliases():
    config = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.from_user({"method": "qwen3_next_mtp", "num_speculative_tokens": 1}).method == "mtp"
    config = SpeculativeConfig.from_user({"model": "/some/draft", "num_speculative_tokens": 2})
    assert config.method == "draft_model" and config.num_lookahead_tokens == 2
    assert SpeculativeConfig.from_user(None) is None


@pytest.mark.parametrize("value,field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": True},
     "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verification_cost": -1}, "verification_cost"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_spec_tokens": 3}, "num_spec_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ("{not json", "JSON"),
    ([1, 2], "JSON object"),
])
def test_bad_config_values_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_user(value)


def test_engine_args_refuse_bad_speculative_options(tiny_llama_path):
    from weir.config import EngineArgs

    with pytest.raises(ValueError, match="speculative_config.method"):
        EngineArgs(str(tiny_llama_path), speculative_config={"method": "nope", "num_speculative_tokens": 1}
                   ).create_config()
    with pytest.raises(ValueError, match="per_request_spec_decode_metrics"):
        EngineArgs(str(tiny_llama_path), per_request_spec_decode_metrics="full").create_config()
    config = EngineArgs(str(tiny_llama_path), speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 2})).create_config()
    assert config.speculative.num_speculative_tokens == 2 and config.draft_model is None


def test_a_draft_with_another_vocabulary_is_a_startup_error(tiny_llama_path, tmp_path):
    from helpers_models import make_tiny_llama
    from weir.config import EngineArgs

    other = make_tiny_llama(tmp_path / "other_vocab", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        EngineArgs(str(tiny_llama_path), speculative_config={
            "method": "draft_model", "model": str(other), "num_speculative_tokens": 2}).create_config()
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineArgs(str(tiny_llama_path), speculative_config={
            "method": "draft_model", "model": str(tmp_path / "missing"), "num_speculative_tokens": 2}).create_config()
    with pytest.raises(ValueError, match="speculative_config.model: model path .*config.json' is a file but not"):
        EngineArgs(str(tiny_llama_path), speculative_config={
            "method": "draft_model", "model": str(other / "config.json"), "num_speculative_tokens": 2}).create_config()


# ---- adaptive rule and stats ---------------------------------------------------------------


def test_best_num_drafts_follows_acceptance_and_cost():
    assert best_num_drafts(0.0, 4, 0.1) == 0  # nothing accepted: drafts only cost
    assert best_num_drafts(0.99, 4, 0.1) == 4
    assert best_num_drafts(0.5, 4, 0.0) == 4  # free verification: always the most
    assert best_num_drafts(0.5, 4, 0.1) == 2  # 1.75 tokens for 1.2 steps beats 1.875 for 1.3
    assert best_num_drafts(0.9, 4, 10.0) == 0


def test_adaptive_drafts_shrink_on_rejections_and_probe_again():
    rule = AdaptiveDrafts(max_drafts=4, verification_cost=0.1)
    assert rule.next_num_drafts() == 2  # the prior: a = 0.5
    for _ in range(3):
        rule.observe(rule.next_num_drafts(), num_accepted=rule.next_num_drafts())
    assert rule.next_num_drafts() == 4
    history = []
    for _ in range(30):
        k = rule.next_num_drafts()
        history.append(k)
        rule.observe(k, 0)
    assert 0 in history and max(history[-10:]) <= 1  # mostly off, probing with one draft now and then
    assert any(k == 1 for k in history[-10:])


def test_request_stats_arithmetic_and_fields():
    stats = RequestSpecStats(num_spec_tokens=3, detailed=True)
    for drafted, accepted in [(3, 2), (3, 0), (2, 2), (0, 0), (1, 1)]:
        stats.observe(drafted, accepted)
    body = stats.to_dict(detailed=True)
    assert body["num_spec_steps"] == 4 == sum(body["acceptance_histogram"])  # the step without drafts is none
    assert body["acceptance_histogram"] == [1, 1, 2, 0]
    assert body["num_accepted_draft_tokens"] == 5 == sum(j * c for j, c in enumerate(body["acceptance_histogram"]))
    assert body["num_draft_tokens"] == 9 == sum(body["per_step_drafted"])
    assert body["per_step_accepted"] == [2, 0, 2, 1]
    assert body["mean_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert body["draft_acceptance_rate"] == pytest.approx(5 / 9)
    assert body["num_spec_tokens"] == 3
    assert set(stats.to_dict()) == set(body) - {"per_step_accepted", "per_step_drafted"}
    merged = stats.merged(RequestSpecStats(3, True, 1, 3, 3, [0, 0, 0, 1], [3], [3]))
    assert merged.num_spec_steps == 5 and merged.acceptance_histogram == [1, 1, 2, 1]
    assert merged.draft_acceptance_rate == pytest.approx(8 / 12)
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        stats.observe(2, 3)
    counters = SpecDecodeCounters(3)
    counters.observe(3, 2)
    counters.observe(2, 1)
    counters.observe(0, 0, num_slots=3)  # slots scheduled, no draft found: no spec step
    assert counters.snapshot() == {"num_drafts": 2, "num_draft_tokens": 5, "num_accepted_tokens": 3,
                                   "accepted_per_position": [2, 1, 0], "num_draft_slots": 3}


# ---- n-gram proposer ----------------------------------------------------------------------


def _table(rows: list[list[int]], width: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    token_ids = torch.zeros(len(rows), width, dtype=torch.int32)
    for index, row in enumerate(rows):
        token_ids[index, : len(row)] = torch.tensor(row)
    return token_ids, torch.tensor([len(row) for row in rows])


def test_ngram_proposes_what_followed_the_longest_suffix():
    token_ids, num_tokens = _table([
        [1, 2, 3, 4, 5, 6, 9, 9, 2, 3],  # suffix [2, 3] (n=2) was followed by 4 5 6
        [7, 8, 7, 8, 7],  # repeating: the earliest occurrence has the most after it
        [1, 2, 3, 4],  # no earlier occurrence of any suffix
        [5, 1, 2, 8, 4, 1, 2, 6, 6, 6, 1, 2],  # [1, 2] twice before: the latest with 3 known after it
    ])
    drafts, counts = propose_ngram(token_ids, num_tokens, torch.arange(4), 12, 1, 3, 3)
    assert counts.tolist() == [3, 2, 0, 3]
    assert drafts[0].tolist() == [4, 5, 6]
    assert drafts[1, :2].tolist() == [8, 7]
    assert drafts[3].tolist() == [6, 6, 6]
    # min_n above every match length: nothing.
    _, counts = propose_ngram(token_ids, num_tokens, torch.arange(4), 12, 3, 3, 3)
    assert counts.tolist()[0] == 0
    # A prompt_lookup_max far past every sequence costs what the sequences allow, not its value.
    big, big_counts = propose_ngram(token_ids, num_tokens, torch.arange(4), 12, 1, 10**12, 3)
    want, want_counts = propose_ngram(token_ids, num_tokens, torch.arange(4), 12, 1, 11, 3)
    assert torch.equal(big, want) and torch.equal(big_counts, want_counts)


def test_written_drafts_stay_inside_max_model_len():
    from types import SimpleNamespace

    from weir.spec_decode.ngram import write_drafts

    token_ids, num_tokens = _table([[1, 2, 3, 1, 2], [4, 4, 4, 4, 4, 4]], width=7)
    table = SimpleNamespace(token_ids=SimpleNamespace(gpu=token_ids), num_tokens=SimpleNamespace(gpu=num_tokens),
                            num_drafts=SimpleNamespace(gpu=torch.zeros(2, dtype=torch.int32)))
    write_drafts(table, torch.tensor([0, 1]), torch.tensor([[7, 8, 9], [5, 5, 5]]), torch.tensor([3, 3]))
    assert token_ids[0].tolist() == [1, 2, 3, 1, 2, 7, 8]
    assert token_ids[1].tolist() == [4, 4, 4, 4, 4, 4, 5]
    assert table.num_drafts.gpu.tolist() == [2, 1]


# ---- rejection sampling -------------------------------------------------------------------


def _flat_layout(num_reqs: int, width: int) -> torch.Tensor:
    return (torch.arange(num_reqs).unsqueeze(1) * width + torch.arange(width)).long()  # [B, S]


def test_greedy_rows_accept_exactly_the_argmax_run():
    # Two requests, 3 drafts each: rows' argmaxes are [5, 6, 7, 8] and [1, 2, 3, 4].
    greedy = torch.tensor([5, 6, 7, 8, 1, 2, 3, 4])
    drafts = torch.tensor([5, 6, 0, 0, 1, 9, 3, 0])  # request 0 accepts 2, request 1 accepts 1
    all_greedy, seeds = torch.ones(8, dtype=torch.bool), torch.zeros(8, dtype=torch.long)
    out = rejection_sample(None, greedy, all_greedy, drafts, None, seeds, torch.arange(8), _flat_layout(2, 4),
                           torch.tensor([3, 3]))
    assert out.num_accepted.tolist() == [2, 1]
    assert out.emitted.tolist() == [[5, 6, 7, -1], [1, 2, -1, -1]]
    # With only one draft available the second row is never checked: its argmax is sampled.
    out = rejection_sample(None, greedy, all_greedy, drafts, None, seeds, torch.arange(8), _flat_layout(2, 4),
                           torch.tensor([1, 0]))
    assert out.emitted.tolist() == [[5, 6, -1, -1], [1, -1, -1, -1]]
    assert out.num_verified.tolist() == [1, 0]


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    expected = probs.double() * samples.shape[0]
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 5 degrees of freedom (6 tokens).
CHI_SQUARE_BOUND = 20.52


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(one_hot_drafts):
    num_samples, vocab = 40_000, 6
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 2.5, 0.1, 1.0, 0.2, -0.5]])  # rows 0, 1
    draft = torch.tensor([[0.0, 2.0, 1.0, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 2.0, 0.5]])
    p, q = target.softmax(-1), draft.softmax(-1)
    gen = torch.Generator().manual_seed(0)
    # Each sample is one request with 2 drafts: 3 logits rows (the last one a bonus row).
    logits = torch.cat([target, torch.zeros(1, vocab)]).repeat(num_samples, 1)  # [3 S, V]
    if one_hot_drafts:
        drafts = torch.tensor([1, 4]).repeat(num_samples, 1)  # always the same two drafts
        q_rows = torch.nn.functional.one_hot(torch.tensor([1, 4]), vocab).float()
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], num_samples, replacement=True, generator=gen)
                              for j in range(2)], dim=1)  # [S, 2] drawn from q
        q_rows = q
        draft_probs = torch.cat([q, torch.zeros(1, vocab)]).repeat(num_samples, 1)
    draft_tokens = torch.cat([drafts, torch.zeros(num_samples, 1, dtype=torch.long)], dim=1).reshape(-1)
    seeds = torch.arange(num_samples).repeat_interleave(3)
    positions = torch.tensor([10, 11, 12]).repeat(num_samples)
    out = rejection_sample(logits, logits.argmax(-1), torch.zeros(3 * num_samples, dtype=torch.bool), draft_tokens,
                           draft_probs, seeds, positions, _flat_layout(num_samples, 3),
                           torch.full((num_samples,), 2))
    first = out.emitted[:, 0]
    assert _chi_square(first, p[0]) < CHI_SQUARE_BOUND
    if not one_hot_drafts:
        assert _chi_square(drafts[:, 0], p[0]) > 10 * CHI_SQUARE_BOUND  # the draft's own distribution fails
    # The second token, where this step emits one, follows the second row's distribution.
    second = out.emitted[:, 1][out.num_accepted >= 1]
    assert second.shape[0] > 1000
    assert _chi_square(second, p[1]) < CHI_SQUARE_BOUND
    # The acceptance rate is sum(min(p, q)) per row (the coupling's maximum).
    expected_rate = float(torch.minimum(p[0], q_rows[0]).sum())
    assert float((out.num_accepted >= 1).double().mean()) == pytest.approx(expected_rate, abs=0.01)


def test_rejection_sampling_is_keyed_on_seed_and_position_only():
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    drafts = torch.tensor([1, 2, 0, 3, 4, 0])
    args = dict(draft_probs=None, flat_of=_flat_layout(2, 3), num_valid=torch.tensor([2, 2]))
    seeds = torch.tensor([7, 7, 7, 9, 9, 9])
    positions = torch.tensor([5, 6, 7, 20, 21, 22])
    both = rejection_sample(logits, logits.argmax(-1), torch.zeros(6, dtype=torch.bool), drafts,
                            seeds=seeds, positions=positions, **args)
    alone = rejection_sample(logits[3:], logits[3:].argmax(-1), torch.zeros(3, dtype=torch.bool), drafts[3:],
                             draft_probs=None, seeds=seeds[3:], positions=positions[3:],
                             flat_of=_flat_layout(1, 3), num_valid=torch.tensor([2]))
    assert both.emitted[1].tolist() == alone.emitted[0].tolist()


# ---- post-update by accepted counts -----------------------------------------------------


def post_update_spec_loop(token_ids, num_tokens, num_computed, counts, idx_mapping, query_lens, sampled,
                          num_emitted, num_rejected):
    for b, row in enumerate(idx_mapping.tolist()):
        if row < 0:
            continue
        is_new = int(num_computed[row]) + int(query_lens[b]) >= int(num_tokens[row])
        num_computed[row] += int(query_lens[b]) - int(num_rejected[b])
        if is_new:
            for token in sampled[b, : int(num_emitted[b])].tolist():
                if num_tokens[row] < token_ids.shape[1]:
                    token_ids[row, num_tokens[row]] = token
                num_tokens[row] += 1
                counts[row, token] += 1


def _post_update_case(device="cpu"):
    gen = torch.Generator().manual_seed(5)
    num_rows, max_len, vocab = 9, 16, 30
    token_ids = torch.randint(0, vocab, (num_rows, max_len), generator=gen, dtype=torch.int32)
    num_tokens = torch.tensor([5, 9, 14, 3, 8, 16, 6, 7, 2], dtype=torch.int32)
    # Verifying rows computed all but their last token; row 3 is mid-prefill (a partial chunk).
    num_computed = (num_tokens - 1).clone()
    num_computed[3] = 0
    counts = torch.zeros(num_rows, vocab, dtype=torch.int32)
    idx_mapping = torch.tensor([0, 1, 2, 3, 5, -1])
    num_drafts = torch.tensor([3, 2, 3, 0, 2, 1])
    query_lens = (1 + num_drafts).int()
    query_lens[3] = 2  # 2 of row 3's 3 prompt tokens
    sampled = torch.randint(0, vocab, (6, 4), generator=gen)
    num_emitted = torch.tensor([4, 1, 3, 1, 2, 2])  # row 2 runs past max_model_len; row 5 is full
    num_rejected = num_drafts - (num_emitted - 1)
    num_rejected[3] = 0
    return [t.to(device) for t in (token_ids, num_tokens, num_computed, counts, idx_mapping, query_lens, sampled,
                                   num_emitted, num_rejected)]


def test_post_update_appends_accepted_runs_and_advances_by_them():
    case = _post_update_case()
    expected = [t.clone() for t in case]
    post_update_spec_loop(*expected)
    got = [t.clone() for t in case]
    inputs.post_update_torch(*got)
    for name, want, have in zip(["token_ids", "num_tokens", "num_computed", "counts"], expected, got):
        assert torch.equal(want, have), name
    assert got[2][0] == case[2][0] + 1 + 3 and got[1][0] == case[1][0] + 4  # all 3 accepted
    assert got[2][1] == case[2][1] + 1 and got[1][1] == case[1][1] + 1  # none accepted
    assert got[1][3] == case[1][3] and got[2][3] == 2  # a partial chunk appends nothing


def test_post_update_kernel_matches_torch_interpreted():
    from weir.kernels.dispatch import interpreted_module, triton_importable

    if not triton_importable():
        pytest.skip("Triton is not installed")
    module = interpreted_module("triton_input_prep")
    case = _post_update_case()
    want = [t.clone() for t in case]
    inputs.post_update_torch(*want)
    got = [t.clone() for t in case]
    module.post_update_triton(*got)
    for have, expected in zip(got[:4], want[:4]):
        assert torch.equal(have, expected)


# ---- scheduling drafts --------------------------------------------------------------------


def make_spec_scheduler(k: int = 3, budget: int = 64, async_scheduling: bool = False, adaptive: bool = False,
                        **spec_options):
    kv = FakeKVCache()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=256,
                             async_scheduling=async_scheduling)
    spec = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive,
                                        **spec_options})
    return Scheduler(config, kv, SpecScheduling(spec, 256, detailed_stats=True)), kv


def add_request(scheduler, request_id: str, num_prompt: int = 4, **params) -> Request:
    sampling = SamplingParams(**{"max_tokens": 20, **params})
    request = Request(request_id, list(range(1, num_prompt + 1)), sampling, frozenset({99}), sampling.max_tokens,
                      seed=0)
    scheduler.add_request(request)
    return request


def spec_result(out, tokens: dict[str, list[int]], verified: dict[str, int] | None = None) -> SampledTokens:
    req_ids = list(out.num_scheduled_tokens)
    verified = verified or {}
    return SampledTokens(req_ids, None, spec_token_ids=[tokens.get(r, [5]) for r in req_ids],
                         num_verified_drafts=[verified.get(r, out.num_draft_tokens.get(r, 0)) for r in req_ids])


def test_decoding_requests_get_their_drafts_within_the_budget():
    scheduler, _ = make_spec_scheduler(k=3)
    request = add_request(scheduler, "a")
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.num_draft_tokens == {}  # the prompt: no drafts yet
    scheduler.update(out, spec_result(out, {"a": [10]}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.num_draft_tokens == {"a": 3}
    assert request.num_computed_tokens == 8 and request.num_output_placeholders == 4
    scheduler.update(out, spec_result(out, {"a": [11, 12]}))  # one draft accepted, two rejected
    assert request.output_token_ids == [10, 11, 12]
    assert request.num_computed_tokens == 6 and request.num_output_placeholders == 0
    assert request.spec_stats.to_dict(detailed=True)["per_step_accepted"] == [1]
    # A token budget smaller than 1 + k cuts the drafts.
    scheduler.config = SchedulerConfig(4, 3, 256, False)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 3} and out.num_draft_tokens == {"a": 2}


def test_drafts_never_let_a_request_pass_max_tokens():
    scheduler, _ = make_spec_scheduler(k=4)
    request = add_request(scheduler, "a", max_tokens=3)
    out = scheduler.schedule()
    scheduler.update(out, spec_result(out, {"a": [10]}))
    out = scheduler.schedule()
    assert out.num_draft_tokens == {"a": 1}  # 1 output so far: one draft and one sampled token make 3
    updates = scheduler.update(out, spec_result(out, {"a": [11, 12]}))
    assert updates[0].finished and request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [10, 11, 12]


def test_a_stop_inside_an_accepted_run_drops_the_rest():
    scheduler, _ = make_spec_scheduler(k=3)
    request = add_request(scheduler, "a")
    out = scheduler.schedule()
    scheduler.update(out, spec_result(out, {"a": [10]}))
    out = scheduler.schedule()
    updates = scheduler.update(out, spec_result(out, {"a": [11, 99, 13, 14]}))  # EOS second
    assert updates[0].finished and updates[0].new_token_ids == [11, 99]
    assert request.output_token_ids == [10, 11, 99] and request.status == RequestStatus.FINISHED_STOPPED
    # The stats keep the verifier's count, as vLLM's do: 3 drafts accepted, 2 of them emitted.
    assert request.spec_stats.to_dict(detailed=True)["per_step_accepted"] == [3]
    assert scheduler.spec.counters.snapshot()["num_accepted_tokens"] == 3
    # Under min_tokens the EOS does not stop (the sampler bans it; here it is forced through).
    scheduler, _ = make_spec_scheduler(k=3)
    request = add_request(scheduler, "b", min_tokens=5)
    out = scheduler.schedule()
    scheduler.update(out, spec_result(out, {"b": [10]}))
    out = scheduler.schedule()
    updates = scheduler.update(out, spec_result(out, {"b": [11, 99, 99, 14]}))
    assert not updates[0].finished and request.output_token_ids == [10, 11, 99, 99, 14]


def test_async_scheduling_plans_on_optimistic_counts_and_corrects_them():
    scheduler, _ = make_spec_scheduler(k=2, async_scheduling=True)
    request = add_request(scheduler, "a")
    first = scheduler.schedule()  # the prompt
    # Its first token is still on the way, but the drafts proposed after it already wait on
    # the device (the proposer ran at the end of the first step).
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 3} and second.num_draft_tokens == {"a": 2}
    assert request.num_computed_tokens == 7 and request.num_output_placeholders == 4
    scheduler.update(first, spec_result(first, {"a": [10]}))
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 3}
    scheduler.update(second, spec_result(second, {"a": [11]}))  # both drafts rejected
    assert request.num_computed_tokens == 10 - 2 and request.num_output_placeholders == 3
    fourth = scheduler.schedule()
    assert fourth.num_scheduled_tokens == {"a": 3}
    scheduler.update(third, spec_result(third, {"a": [12, 13, 14]}))  # both accepted
    scheduler.update(fourth, spec_result(fourth, {"a": [15]}))
    assert request.output_token_ids == [10, 11, 12, 13, 14, 15]
    # Every known token but the last is computed; nothing is in flight.
    assert request.num_computed_tokens == request.num_tokens - 1 and request.num_output_placeholders == 0
    assert request.spec_stats.acceptance_histogram == [2, 0, 1]


def test_disable_by_batch_size_and_the_adaptive_rule_choose_the_drafts():
    scheduler, _ = make_spec_scheduler(k=3, disable_by_batch_size=2)
    for name in "ab":
        add_request(scheduler, name)
    out = scheduler.schedule()
    scheduler.update(out, spec_result(out, {}))
    assert scheduler.schedule().num_draft_tokens == {}  # two running: speculation is off
    scheduler, _ = make_spec_scheduler(k=4, adaptive=True)
    request = add_request(scheduler, "a", max_tokens=200)
    out = scheduler.schedule()
    scheduler.update(out, spec_result(out, {}))
    drafts = []
    for _ in range(12):
        out = scheduler.schedule()
        drafts.append(out.num_draft_tokens.get("a", 0))
        scheduler.update(out, spec_result(out, {"a": [5]}))  # every draft rejected
    assert drafts[0] == 2 and drafts[-1] <= 1 and 0 in drafts
    assert request.spec_stats.draft_acceptance_rate == 0


def test_plan_step_pads_a_verify_batch_to_its_graph_width():
    """A batch whose requests have at most 1 + k tokens each runs in the graph of that width: its
    tokens are size * width, those past the last request belonging to none."""
    import numpy as np

    from weir.runner.input_buffers import plan_step
    from weir.scheduler.output import CachedRequestData, SchedulerOutput

    class Table:
        row_of = {"a": 3, "b": 5, "c": 0}
        num_computed_host = np.array([7, 0, 0, 9, 0, 4, 0, 0, 0], dtype=np.int64)
        padding_row = 8

    out = SchedulerOutput(new_reqs=[], cached_reqs=CachedRequestData(), num_scheduled_tokens={"a": 4, "b": 2, "c": 1},
                          total_num_scheduled_tokens=7, sampling_req_ids={"a", "b", "c"}, min_tokens_req_ids=set(),
                          finished_req_ids=set(), preempted_req_ids=set(), num_draft_tokens={"a": 3, "b": 1})
    seen = []

    def graph_size(num_reqs, max_query_len):
        seen.append((num_reqs, max_query_len))
        return 4, 4  # the next captured size of width 1 + 3

    plan = plan_step(out, Table(), graph_size, max_model_len=64)
    assert seen == [(3, 4)]
    assert plan.padded_rows.tolist() == [3, 5, 0, 8] and plan.batch == 4
    assert plan.query_start_loc.tolist() == [0, 4, 6, 7, 8]  # the padding request owns one token
    assert plan.num_tokens == 16 and plan.max_query_len == 4 and plan.max_seq_len == 64
    assert plan.num_drafts.tolist() == [3, 1, 0] and plan.graph_width == 4
    eager = plan_step(out, Table(), lambda num_reqs, max_query_len: None, max_model_len=64)
    assert eager.num_tokens == 7 and eager.max_seq_len == 13 and eager.graph_size is None
