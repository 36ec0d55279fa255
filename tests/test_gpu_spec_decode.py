"""Speculative decoding on CUDA: greedy tokens equal with and without drafts (fp32 weights and
logits, where they are exact) for every method, with the decode and verification graphs
replayed; no implicit synchronisation in the step loop; the post-update kernel compiled against
its torch version. Runs on the GPU machine (marked gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import assert_nothing_held, assert_steps_do_not_sync, record_graph_replays
from helpers_models import (DEEPSEEK_TRITON_SHAPES, add_made_up_deepseek_mtp_weights, add_made_up_mtp_weights,
                            make_tiny_deepseek_v3, make_tiny_deepseek_v32, make_tiny_eagle, make_tiny_llama, make_tiny_qwen3_next)
from weir import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_TOKENS = 32
K = 3


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama_gpu"), with_tokenizer=True, num_hidden_layers=4,
                           hidden_size=256, intermediate_size=512)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for length in (5, 17, 33, 64, 100, 7, 40, 12):
        phrase = [rng.randrange(256) for _ in range(3)]
        out.append((phrase * 60)[:length] if length % 2 else [rng.randrange(256) for _ in range(length)])
    return out


def speculative(method: str, path, tmp_path_factory) -> dict:
    config = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif method == "draft_model":
        config["model"] = str(path)  # the target itself: every draft must be accepted
    elif method in ("eagle", "eagle3"):
        config["model"] = str(make_tiny_eagle(tmp_path_factory.mktemp(method), path, eagle3=method == "eagle3",
                                              aux_layers=[1, 2, 3]))
    return config


def run(path, params, speculative_config=None, **options):
    llm = LLM(str(path), dtype="float32", gpu_memory_utilization=0.3, max_model_len=512, max_num_batched_tokens=128,
              speculative_config=speculative_config, **options)
    replays = record_graph_replays(llm) if llm.engine.runner.graphs is not None else []
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return llm, outputs, [width for _, width, _ in replays]


def assert_proposer_graphs_replay(llm, params, width: int) -> None:
    """The draft network's passes after verify steps of ``width`` tokens per request were
    captured, and another run replays them (``weir.spec_decode.proposal_graphs``)."""
    graphs, keys = llm.engine.runner.graphs, []
    assert ("proposer", 8, width) in graphs._named
    original = graphs.replay_named

    def replay_named(key):
        keys.append(key)
        return original(key)

    graphs.replay_named = replay_named
    llm.generate([{"prompt_token_ids": p} for p in prompts(1)], params, use_tqdm=False)
    assert any(key[2] == width for key in keys)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_greedy_equal_with_graphs(llama_path, tmp_path_factory, method):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    _, want, _ = run(llama_path, params)
    config = speculative(method, llama_path, tmp_path_factory)
    llm, got, replays = run(llama_path, params, config)
    for mine, theirs in zip(got, want):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(mine.outputs[0].logprobs, theirs.outputs[0].logprobs):
            token = next(iter(b))
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-3)
    counters = llm.engine.scheduler.spec.counters
    assert counters.num_draft_tokens > 0
    if method == "draft_model":
        assert counters.num_accepted_tokens == counters.num_draft_tokens
    assert 1 + K in replays  # verification steps replayed the graphs of width 1 + k
    if method != "ngram":  # and the draft network's passes after them replayed theirs
        assert_proposer_graphs_replay(llm, params, 1 + K)
    assert_nothing_held(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_no_implicit_sync_in_the_step_loop(llama_path, tmp_path_factory, method):
    llm = LLM(str(llama_path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512,
              speculative_config=speculative(method, llama_path, tmp_path_factory))
    assert_steps_do_not_sync(llm)


MTP_CHECKPOINTS = {
    "qwen3_next": lambda path: add_made_up_mtp_weights(make_tiny_qwen3_next(path, with_tokenizer=True)),
    "deepseek_v3": lambda path: add_made_up_deepseek_mtp_weights(  # triton_mla's shapes: 16+ rope dims
        make_tiny_deepseek_v3(path, with_tokenizer=True, **DEEPSEEK_TRITON_SHAPES)),
    "deepseek_v32": lambda path: add_made_up_deepseek_mtp_weights(  # a sparse module, index_topk 8
        make_tiny_deepseek_v32(path, with_tokenizer=True, **DEEPSEEK_TRITON_SHAPES)),
}


# It once ran past 480 s with no traceback. The thread method dumps every thread's stack even
# when the main thread is blocked inside a CUDA call, where a signal handler never runs.
@pytest.mark.timeout(420, method="thread")
@pytest.mark.parametrize("family", list(MTP_CHECKPOINTS))
def test_mtp_greedy_equal(tmp_path, family):
    """Qwen3-Next's MTP block and DeepSeek-V3's and V3.2's next-token modules (through triton_mla,
    in fp32 its Triton kernels, V3.2's sparse ones, and the Triton MoE); verify steps and the
    head's passes after them replay graphs (Qwen3-Next's DeltaNet layers inside them run per
    draft position on a scratch state)."""
    path = MTP_CHECKPOINTS[family](tmp_path / family)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    _, want, _ = run(path, params)
    llm, got, widths = run(path, params, {"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.scheduler.spec.counters.num_draft_tokens > 0
    assert 3 in widths  # verify steps of 1 + 2 tokens per request replayed a graph
    assert_proposer_graphs_replay(llm, params, 3)
    assert_nothing_held(llm)


@pytest.mark.parametrize("graphs", [True, False])
def test_linear_attention_ngram_greedy_equal(tmp_path, graphs):
    """A hybrid model's verify steps, in width graphs and eagerly: its DeltaNet state keeps only
    the accepted tokens (a wrong state would change the greedy tokens that follow)."""
    path = make_tiny_qwen3_next(tmp_path / "qwen3_next", with_tokenizer=True)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    options = {} if graphs else {"enforce_eager": True}
    _, want, _ = run(path, params, **options)
    config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm, got, widths = run(path, params, config, **options)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    counters = llm.engine.scheduler.spec.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # some drafts kept, some rejected
    assert (1 + K in widths) == graphs
    assert_nothing_held(llm)


def test_linear_attention_verify_has_no_implicit_sync(tmp_path):
    path = make_tiny_qwen3_next(tmp_path / "qwen3_next", with_tokenizer=True)
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    assert_steps_do_not_sync(llm)


def test_post_update_kernel_compiled_matches_torch():
    from test_spec_decode_units import _post_update_case

    from weir.kernels import triton_input_prep
    from weir.runner import inputs

    case = _post_update_case("cuda")
    want = [t.clone() for t in case]
    inputs.post_update_torch(*want)
    got = [t.clone() for t in case]
    triton_input_prep.post_update_triton(*got)
    for have, expected in zip(got[:4], want[:4]):
        assert torch.equal(have, expected)
