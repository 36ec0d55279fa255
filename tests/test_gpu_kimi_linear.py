"""Kimi Linear end to end on CUDA in bf16: fla's KDA kernels (chunk prefill, fused recurrent decode
in place on the state pool) with Weir's slot-indexed convs, the Triton MLA backend without RoPE,
the Triton fused MoE, CUDA graphs and eager, against transformers in fp32 and bf16 (fla blocked in
its process); the KDA backend against the torch reference (``weir.testing``); 16-bit states; and
no implicit synchronisation in the decode loop. Runs on the GPU machine (marked gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_harness import assert_nothing_held, assert_steps_do_not_sync
from helpers_models import make_tiny_kimi_linear
from helpers_parity import SLACK, Fp32Reference
from weir import LLM, SamplingParams
from weir.testing import check_linear_attention_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Shapes the kernels take: KDA head_dim a multiple of 16, MLA latent and rope dims powers of
    # two >= 16 (triton_mla); 16 experts, top 4.
    return make_tiny_kimi_linear(
        tmp_path_factory.mktemp("kimi_linear_gpu"), with_tokenizer=True, hidden_size=256, intermediate_size=256,
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3, 5], "num_heads": 4, "head_dim": 64,
                            "short_conv_kernel_size": 4},
        kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        num_local_experts=16, num_experts_per_tok=4, moe_intermediate_size=128)


def test_the_kda_backend_conforms():
    pytest.importorskip("fla")
    from weir.plugins.attention.kda_fla import FlaKDABackend

    for state_dtype in (torch.float32, torch.bfloat16):
        check_linear_attention_backend(FlaKDABackend, device="cuda", dtype=torch.bfloat16, state_dtype=state_dtype)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_bf16_parity_through_fla(checkpoint, state_dtype):
    """Within bf16 tolerance of transformers, judged against transformers in fp32: Weir in bf16
    (graphs and eager) parts from fp32's greedy tokens only at near-ties, and (eager) its logits
    where the context is still fp32's are about as close to fp32's as transformers' bf16 ones."""
    pytest.importorskip("fla")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100, 130, 250)]
    reference = Fp32Reference.of(checkpoint, prompts, NUM_TOKENS, SLACK[state_dtype])
    print(f"transformers bf16: tokens identical to fp32 per prompt {reference.hf_matched}; "
          f"near-tie margin {reference.margin:.3g}")
    for eager in (True, False):
        mode = f"{state_dtype} states, {'eager' if eager else 'graphs'}"
        llm = LLM(str(checkpoint), dtype="bfloat16", enforce_eager=eager, max_num_batched_tokens=128,
                  gpu_memory_utilization=0.3, max_model_len=512, linear_state_dtype=state_dtype)
        runner = llm.engine.runner
        assert runner.caches.describe_backends() == "mla=triton_mla, kimi_delta_attention=kda_fla"
        assert runner.moe_backend.name == "triton"
        assert (runner.graphs is not None) == (not eager)
        states = [s for s in runner.caches.layer_states if s is not None]
        assert states and all(s.recurrent_state.dtype == getattr(torch, state_dtype) for s in states)
        reference.assert_run(llm, prompts, PARAMS, mode, eager)
        assert_nothing_held(llm)
        del llm
        torch.cuda.empty_cache()


def test_chunked_prefill_and_prefix_hits_through_fla(checkpoint):
    """Small chunks (state carried between chunk kernels, across mixed steps and chunk
    boundaries off fla's 64) and a prefix hit resuming the KDA layers from a checkpoint follow
    fp32's greedy tokens as a whole prefill does: parting from them only at near-ties. With the
    default (fp32) states, CUDA graphs on."""
    pytest.importorskip("fla")
    rng = random.Random(1)
    base = [rng.randrange(256) for _ in range(200)]
    prompts = [base, base[:96] + [rng.randrange(256) for _ in range(40)], base]
    reference = Fp32Reference.of(checkpoint, prompts, NUM_TOKENS, SLACK["float32"])
    results, cached = {}, {}
    for name, options in {"whole": dict(enable_prefix_caching=False),
                          "chunked": dict(max_num_batched_tokens=48, block_size=16)}.items():
        llm = LLM(str(checkpoint), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512, **options)
        runner = llm.engine.runner
        states = [s for s in runner.caches.layer_states if s is not None]
        assert runner.graphs is not None and states and all(s.recurrent_state.dtype == torch.float32 for s in states)
        outputs = [llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in prompts]
        results[name] = [o.outputs[0].token_ids for o in outputs]
        cached[name] = [o.num_cached_tokens for o in outputs]
        assert_nothing_held(llm)
        del llm
        torch.cuda.empty_cache()
    assert cached["chunked"][2] > 0, f"the third prompt (the first again) found no prefix: cached tokens {cached}"
    reference.assert_chunked_follows(results, cached)


def test_no_implicit_sync_in_decode(checkpoint):
    pytest.importorskip("fla")
    assert_steps_do_not_sync(LLM(str(checkpoint), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512))
