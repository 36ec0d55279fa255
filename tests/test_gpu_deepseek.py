"""DeepSeek-V3, DeepSeek-V3.2 and GLM-5 end to end on CUDA in bf16: the Triton MLA / DSA backend
(``triton_mla``: absorbed attention over the latent cache and, on sparse layers, the lightning
indexer's scores and top-k over the cached indexer keys), the Triton fused MoE after grouped
sigmoid routing, CUDA graphs (mixed steps too) and eager, against transformers in fp32 and bf16
(and Weir in fp32 against transformers in fp32, the sharp check); chunked prefill
and prefix-cache hits through sparse layers; and no implicit synchronisation in the decode loop.
Runs on the GPU machine (marked gpu). tests/test_deepseek.py holds the fp32 CPU parity of the
same families, tests/test_mla_triton.py the backend's kernels against an oracle."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine_harness import assert_nothing_held, assert_steps_do_not_sync, record_graph_replays
from helpers_models import (DEEPSEEK_TRITON_SHAPES, make_tiny_deepseek_v3, make_tiny_deepseek_v32,
                            make_tiny_glm_moe_dsa)
from helpers_parity import SLACK, Fp32Reference, assert_fp32_run
from weir import LLM, SamplingParams
from weir.testing import transformers_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
MLA_SLACK = SLACK["float32"]  # no linear-attention states to round

SHAPES = DEEPSEEK_TRITON_SHAPES  # the prompts below reach 282 positions, past YaRN's original 128
# DSA: each query keeps 16 keys of up to 282; 32 indexer heads of 32 dims (RoPE on the first 16).
DSA = dict(index_n_heads=32, index_head_dim=32, index_topk=16)
MAKERS = {
    "v3": lambda path: make_tiny_deepseek_v3(path, with_tokenizer=True, **SHAPES),
    "v3_no_q_lora": lambda path: make_tiny_deepseek_v3(  # q_proj, attention biases, rotate_half RoPE
        path, with_tokenizer=True, **{**SHAPES, "q_lora_rank": None}, n_shared_experts=2, attention_bias=True,
        rope_interleave=False),
    "v32": lambda path: make_tiny_deepseek_v32(path, with_tokenizer=True, **SHAPES, **DSA),
    "glm_moe_dsa": lambda path: make_tiny_glm_moe_dsa(path, with_tokenizer=True, **SHAPES, **DSA),
    # Layers 1, 3 and 4 attend to the slot lists the last "full" layer before them picked.
    "glm_moe_dsa_shared": lambda path: make_tiny_glm_moe_dsa(
        path, with_tokenizer=True, **SHAPES, **DSA, num_hidden_layers=5,
        indexer_types=["full", "shared", "full", "shared", "shared"]),
}
LAYER_KIND = {"v3": "mla", "v3_no_q_lora": "mla", "v32": "sparse_mla", "glm_moe_dsa": "sparse_mla",
              "glm_moe_dsa_shared": "sparse_mla"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(name)``: the tiny checkpoint of ``MAKERS[name]``, made once per module."""
    made = {}

    def checkpoint(name: str):
        if name not in made:
            made[name] = MAKERS[name](tmp_path_factory.mktemp(name))
        return made[name]

    return checkpoint


def assert_runs_on_triton(llm: LLM, name: str, eager: bool) -> None:
    """Every layer on the Triton MLA / DSA backend, the Triton MoE, CUDA graphs unless eager."""
    runner = llm.engine.runner
    assert runner.caches.describe_backends() == f"{LAYER_KIND[name]}=triton_mla"
    assert runner.moe_backend.name == "triton"
    assert (runner.graphs is not None) == (not eager)


def free_cuda_memory() -> None:
    gc.collect()  # watch_engine's closures (Fp32Reference.assert_run) hold the engine in reference cycles
    torch.cuda.empty_cache()


# GLM-5 shares V3.2's layers but for the indexer's RoPE and its shared layers: one graphs run each.
PARITY_CASES = {"v3": (True, False), "v3_no_q_lora": (True, False), "v32": (True, False), "glm_moe_dsa": (False,),
                "glm_moe_dsa_shared": (False,)}


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_bf16_parity_through_triton_mla(checkpoints, name):
    """Within bf16 tolerance of transformers, judged against transformers in fp32: Weir in bf16
    (graphs and eager; GLM-5 graphs only) parts from fp32's greedy tokens only at near-ties, and
    (eager) its logits where the context is still fp32's are about as close to fp32's as
    transformers' bf16 ones. Prompts of 1 to 250 tokens, the longer ones chunked by a 128-token
    step budget; on the sparse models most queries attend to 16 of their keys."""
    path = checkpoints(name)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100, 130, 250)]
    reference = Fp32Reference.of(path, prompts, NUM_TOKENS, MLA_SLACK)
    print(f"{name}: transformers bf16: tokens identical to fp32 per prompt {reference.hf_matched}; "
          f"near-tie margin {reference.margin:.3g}")
    for eager in PARITY_CASES[name]:
        llm = LLM(str(path), dtype="bfloat16", enforce_eager=eager, max_num_batched_tokens=128,
                  gpu_memory_utilization=0.3, max_model_len=512)
        assert_runs_on_triton(llm, name, eager)
        replays = record_graph_replays(llm) if not eager else []
        reference.assert_run(llm, prompts, PARAMS, f"{name}, {'eager' if eager else 'graphs'}", eager)
        # The chunked prompts prefill beside decodes in mixed-step graphs: MLA (DSA's indexer
        # too) and the MoE over padding tokens that belong to no request.
        assert eager or any(tokens is not None for _, _, tokens in replays), "no mixed-step graph replayed"
        assert_nothing_held(llm)
        del llm
        free_cuda_memory()


@pytest.mark.parametrize("name", ["v3", "v32", "glm_moe_dsa_shared"])
def test_fp32_follows_transformers_fp32_with_mixed_step_graphs(checkpoints, name):
    """In fp32 (exact dots in the MLA, DSA and MoE kernels) Weir parts from transformers fp32 only
    at near-exact ties, with CUDA graphs (the chunked prompts' mixed steps replayed: MLA, the
    indexer and the MoE over padding tokens owned by no request) and eagerly. Sharper than the
    bf16 parity above, whose near-tie margin exceeds every logit gap of these tiny models."""
    path = checkpoints(name)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100, 130, 250)]
    truth = transformers_greedy(path, prompts, NUM_TOKENS, device="cuda", dtype="float32")
    for eager in (False, True):
        llm = LLM(str(path), dtype="float32", enforce_eager=eager, max_num_batched_tokens=128,
                  gpu_memory_utilization=0.3, max_model_len=512)
        assert_runs_on_triton(llm, name, eager)
        replays = record_graph_replays(llm) if not eager else []
        assert_fp32_run(llm, prompts, PARAMS, truth, f"{name}, {'eager' if eager else 'graphs'}")
        assert eager or any(tokens is not None for _, _, tokens in replays), "no mixed-step graph replayed"
        assert_nothing_held(llm)
        del llm
        free_cuda_memory()


def test_chunked_prefill_and_prefix_hits_through_dsa(checkpoints):
    """DeepSeek-V3.2 in 48-token chunks over 16-token blocks (each chunk's queries score and
    attend to the indexer and latent keys of the earlier chunks from the cache), and prefix hits
    (the second prompt shares 6 blocks with the first, the third is the first again: 12 blocks
    hit) follow fp32's greedy tokens as a whole prefill does: parting from them only at
    near-ties. CUDA graphs on."""
    path = checkpoints("v32")
    rng = random.Random(1)
    base = [rng.randrange(256) for _ in range(200)]
    prompts = [base, base[:96] + [rng.randrange(256) for _ in range(40)], base]
    reference = Fp32Reference.of(path, prompts, NUM_TOKENS, MLA_SLACK)
    results, cached = {}, {}
    for run, options in {"whole": dict(enable_prefix_caching=False),
                         "chunked": dict(max_num_batched_tokens=48, block_size=16)}.items():
        llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512, **options)
        assert_runs_on_triton(llm, "v32", eager=False)
        outputs = [llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in prompts]
        results[run] = [o.outputs[0].token_ids for o in outputs]
        cached[run] = [o.num_cached_tokens for o in outputs]
        assert_nothing_held(llm)
        del llm
        free_cuda_memory()
    assert cached["chunked"] == [0, 96, 192], f"prefix hits: cached tokens {cached}"
    reference.assert_chunked_follows(results, cached)


@pytest.mark.parametrize("name", ["v3", "v32"])
def test_no_implicit_sync_in_decode(checkpoints, name):
    """Decode steps (replaying CUDA graphs; on V3.2 past index_topk, so through the indexer's
    top-k) read nothing back on the host."""
    assert_steps_do_not_sync(LLM(str(checkpoints(name)), dtype="bfloat16", gpu_memory_utilization=0.3,
                                 max_model_len=512))
    free_cuda_memory()
