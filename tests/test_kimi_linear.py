"""Kimi Linear against transformers, fp32 on the CPU (``weir.testing.transformers_greedy`` runs
transformers with fla blocked, so its torch KDA is the reference): logits within 1e-4 relative and
32 identical greedy tokens for 8 prompts of 1 to 70 tokens, through chunked prefill across chunk
boundaries (conv and recurrent state carried between chunks), preemption, too few state slots,
both scheduling modes and hybrid prefix caching (on by default: KDA layers resume from state
checkpoints); plus aborts giving back their slots, 16-bit recurrent states, both checkpoint
layouts, the released 48B config and the configs refused by name.

The tiny checkpoint (tests/helpers_models.py ``make_tiny_kimi_linear``): 5 layers declared as the
released checkpoints declare them (1-indexed ``kda_layers`` [1, 2, 4], ``full_attn_layers`` [3, 5]),
the remote-code config names, MLA without q LoRA, a dense first layer under ``mlp.``, 8 experts
top-2 plus a shared expert, a non-zero correction bias and slow KDA decays."""

from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch

from engine_harness import assert_nothing_held, watch_engine
from helpers_models import make_tiny_kimi_linear
from weir import LLM, SamplingParams
from weir.testing import transformers_greedy

pytestmark = pytest.mark.integration

NUM_TOKENS = 32
PROMPT_LENGTHS = (1, 3, 9, 17, 24, 40, 55, 70)
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_kimi_linear(tmp_path_factory.mktemp("kimi_linear"), with_tokenizer=True)


@pytest.fixture(scope="module")
def references(checkpoint):
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(length)] for length in PROMPT_LENGTHS]
    return prompts, transformers_greedy(checkpoint, prompts, NUM_TOKENS)


def assert_matches(watch, outputs, expected, num_tokens: int = NUM_TOKENS) -> None:
    for output, (expected_tokens, expected_logits) in zip(outputs, expected):
        assert output.outputs[0].token_ids == expected_tokens[:num_tokens], f"request {output.request_id}"
        logits = torch.stack(watch.logits[output.request_id][:num_tokens])
        rel_err = ((logits - expected_logits[:num_tokens]).abs().max() / expected_logits.abs().max()).item()
        assert rel_err < 1e-4, f"request {output.request_id}: max relative error {rel_err:.2e}"


def bytes_for_blocks(checkpoint, num_blocks: int) -> int:
    probe = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, max_model_len=128)
    caches = probe.engine.runner.caches
    return num_blocks * sum(caches.bytes_per_block(group) for group in caches.groups)


SCENARIOS = {
    "plain": {},
    "chunked_prefill": dict(max_num_batched_tokens=16, block_size=4),
    "preemption": dict(block_size=4, max_model_len=128),  # and a KV cache of 41 blocks (below)
    "few_state_slots": {},  # memory for 2 state slots only: 8 requests take turns
}
RUNS = [("plain", True), ("chunked_prefill", True), ("chunked_prefill", False), ("preemption", True),
        ("preemption", False), ("few_state_slots", True)]


@pytest.mark.parametrize("scenario,async_scheduling", RUNS)
def test_matches_transformers(checkpoint, references, scenario, async_scheduling, monkeypatch, caplog):
    from weir.runner.model_runner import ModelRunner

    prompts, expected = references
    options = dict(SCENARIOS[scenario])
    if scenario == "preemption":  # 40 usable blocks of 4 tokens: far less than 8 requests of up to 102 need
        options["kv_cache_memory_bytes"] = bytes_for_blocks(checkpoint, 41)
    if scenario == "few_state_slots":  # room for 3 slots' state: 2 slots plus the padding slot
        monkeypatch.setattr(ModelRunner, "_state_room_bytes",
                            lambda self: 2 * 3 * sum(self.caches.backend_of(layer).state_bytes_per_slot(layer)
                                                     for layer in self.caches.state_layers))
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", async_scheduling=async_scheduling, **options)
    watch = watch_engine(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)

    engine = llm.engine
    assert engine.runner.caches.describe_backends() == "mla=mla_torch, kimi_delta_attention=kda_torch"
    assert engine.config.cache.enable_prefix_caching  # on by default for hybrid models
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if scenario == "chunked_prefill":
        assert watch.num_steps > NUM_TOKENS + 70 // 16  # prompts needed several chunks
    if scenario == "few_state_slots":
        assert engine.scheduler.kv_cache.state_slots.num_slots == 2
        assert "2 state slots, so at most 2 requests run at once" in caplog.text
    assert_matches(watch, outputs, expected)
    assert_nothing_held(llm)


def test_prefix_hits_resume_the_kda_layers_from_checkpoints(checkpoint, references, caplog):
    """Requests run one after another, each sharing a prefix with the earlier ones: the hits
    resume the KDA layers from the state checkpoints kept at block boundaries (retention 0: each
    prompt's last boundary and where shared prefixes diverge), and every result is transformers'."""
    num_tokens = 12
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    rng = random.Random(3)
    base = [rng.randrange(256) for _ in range(37)]
    (reply, _), = transformers_greedy(checkpoint, [base], num_tokens)
    sequence = [  # (prompt, tokens it hits)
        (base, 0),
        (base[:16] + [rng.randrange(256) for _ in range(7)], 0),  # keeps the junction at 16
        (base[:16] + [rng.randrange(256) for _ in range(5)], 16),
        (base + reply + [rng.randrange(256) for _ in range(6)], 36),  # the next turn of a chat
        (base, 36),
    ]
    prompts = [prompt for prompt, _ in sequence]
    expected = transformers_greedy(checkpoint, prompts, num_tokens)
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, max_model_len=128,
                  max_num_batched_tokens=16)
    assert "prefix caching: on for KimiLinearForCausalLM (hybrid)" in caplog.text
    watch = watch_engine(llm)
    outputs = [llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for prompt in prompts]
    assert [output.num_cached_tokens for output in outputs] == [hits for _, hits in sequence]
    assert_matches(watch, outputs, expected, num_tokens)
    assert_nothing_held(llm)


def test_aborted_requests_give_back_their_slots(checkpoint, references):
    prompts, _ = references
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", max_num_seqs=4)
    engine = llm.engine
    for index, prompt in enumerate(prompts[4:]):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv_cache.state_slots.num_free == 0
    engine.abort_request(["r0", "r2"])
    assert engine.scheduler.kv_cache.state_slots.num_free == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


def test_16bit_recurrent_state(checkpoint, references):
    """``linear_state_dtype="bfloat16"`` stores the KDA states rounded; the maths stays fp32."""
    prompts, expected = references
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", linear_state_dtype="bfloat16")
    states = [state for state in llm.engine.runner.caches.layer_states if state is not None]
    assert len(states) == 3 and all(state.recurrent_state.dtype == torch.bfloat16 for state in states)
    assert all(state.conv_state.dtype == torch.float32 for state in states)
    watch = watch_engine(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for output, (expected_tokens, expected_logits) in zip(outputs, expected):
        logits = torch.stack(watch.logits[output.request_id][:4])
        rel_err = ((logits - expected_logits[:4]).abs().max() / expected_logits.abs().max()).item()
        assert 0 < rel_err < 2e-2, f"request {output.request_id}: {rel_err:.1e}"
        assert output.outputs[0].token_ids[:4] == expected_tokens[:4]


def test_the_checkpoint_transformers_saves_loads_too(tmp_path, references):
    """``save_pretrained``'s layout: layer_types beside linear_attn_config, the dense layer under
    ``block_sparse_moe.``. The same weights, so the same results."""
    path = make_tiny_kimi_linear(tmp_path / "hf_layout", with_tokenizer=True, layout="transformers")
    config = json.loads((path / "config.json").read_text())
    assert "layer_types" in config and "mlp_layer_types" in config
    prompts, expected = references
    llm = LLM(str(path), device="cpu", dtype="float32")
    watch = watch_engine(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[3:6]], PARAMS, use_tqdm=False)
    assert_matches(watch, outputs, expected[3:6])


def test_model_layout_follows_the_one_indexed_lists(checkpoint):
    from weir.plugins.models.kimi_linear import KimiDeltaAttention
    from weir.plugins.models.deepseek_v3 import MLAAttention

    llm = LLM(str(checkpoint), device="cpu", dtype="float32")
    model = llm.engine.runner.model
    kinds = [type(layer.self_attn) for layer in model.model.layers]
    assert kinds == [KimiDeltaAttention, KimiDeltaAttention, MLAAttention, KimiDeltaAttention, MLAAttention]
    assert [layer.feed_forward_name for layer in model.model.layers] == ["mlp"] + ["block_sparse_moe"] * 4
    assert all(layer.self_attn.rotary_emb is None for layer, kind in zip(model.model.layers, kinds)
               if kind is MLAAttention)  # no RoPE anywhere
    assert [spec.layer_idx for spec in model.state_layers()] == [0, 1, 3]
    assert [spec.layer_idx for spec in model.attention_layers()] == [2, 4]
    assert model.attention_layers()[0].scale == pytest.approx((16 + 8) ** -0.5)
    moe = model.model.layers[1].block_sparse_moe
    assert moe.experts.num_shared_experts == 1 and moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.abs().sum() > 0
    assert model.model.layers[0].self_attn.dt_bias.dtype == torch.float32


# ---- the released config, and configs refused by name ---------------------------------------------

# Kimi-Linear-48B-A3B's config.json, as published (remote-code names).
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 163584, "eos_token_id": 163586,
    "pad_token_id": 163839, "torch_dtype": "bfloat16", "first_k_dense_replace": 1, "head_dim": 72,
    "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}


def _model_config(folder):
    from helpers_models import tiny_model_config

    return tiny_model_config(folder, dtype=torch.bfloat16, max_model_len=4096)


def _write_config(folder, config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_48b_config_builds_as_published(tmp_path):
    """On the meta device: 20 KDA layers of ~2.1 MiB state each (about 42 MiB a request, fp32
    states), 7 MLA layers of 576 cached values per token, the checkpoint's own tensor names."""
    from weir.plugins.attention.kda_torch import TorchKDABackend
    from weir.plugins.models.kimi_linear import KimiLinearForCausalLM
    from weir.weights.loader import checkpoint_names

    model_config = _model_config(_write_config(tmp_path / "kimi-48b", KIMI_LINEAR_48B))
    with torch.device("meta"):
        model = KimiLinearForCausalLM(model_config)
    kda, mla = model.state_layers(), model.attention_layers()
    assert [spec.layer_idx + 1 for spec in mla] == [4, 8, 12, 16, 20, 24, 27]
    assert len(kda) == 20 and {(s.num_heads, s.head_dim, s.conv_kernel) for s in kda} == {(32, 128, 4)}
    assert {spec.cache_dim for spec in mla} == {576} and {spec.scale for spec in mla} == {192 ** -0.5}
    backend = TorchKDABackend(torch.bfloat16, torch.device("cpu"))
    per_request = sum(backend.state_bytes_per_slot(spec) for spec in kda)
    assert per_request == 20 * (12288 * 4 * 2 + 32 * 128 * 128 * 4)  # ~41.9 MiB
    names = set(checkpoint_names(KimiLinearForCausalLM, model_config))
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.f_b_proj.weight",
                 "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias",
                 "model.layers.0.self_attn.b_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.3.self_attn.q_proj.weight", "model.layers.1.block_sparse_moe.experts.255.w2.weight",
                 "model.layers.1.block_sparse_moe.experts.0.w3.weight",
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "model.layers.26.block_sparse_moe.shared_experts.up_proj.weight", "lm_head.weight"):
        assert name in names, name
    assert "model.layers.1.mlp.gate_proj.weight" not in names


def _refused(tmp_path, name, match, edit):
    config = json.loads(json.dumps(KIMI_LINEAR_48B))
    edit(config)
    from weir.plugins.models.kimi_linear import KimiLinearForCausalLM

    model_config = _model_config(_write_config(tmp_path / name, config))
    with pytest.raises(ValueError, match=match), torch.device("meta"):
        KimiLinearForCausalLM(model_config)


@pytest.mark.parametrize("name, match, edit", [
    ("safe_gate", r"gate_lower_bound=-5.0 asks for a KDA gate variant of newer Kimi models.*no reference",
     lambda c: c["linear_attn_config"].update(gate_lower_bound=-5.0)),
    ("zero_bound", r"gate_lower_bound=0 asks for a KDA gate variant",
     lambda c: c["linear_attn_config"].update(gate_lower_bound=0)),
    ("top_level_bound", r"gate_lower_bound=-5.0 asks for a KDA gate variant",
     lambda c: c["linear_attn_config"].update(gate_lower_bound=False) or c.update(gate_lower_bound=-5.0)),
    ("safe_gate_flag", r"safe_gate=True asks for a KDA gate variant",
     lambda c: c["linear_attn_config"].update(safe_gate=True)),
    ("gate_in_kernel", r"use_gate_in_kernel=True asks for a KDA gate variant",
     lambda c: c.update(use_gate_in_kernel=True)),
    ("glm5_next_bound", r"linear_lower_bound=-5.0 asks for a KDA gate variant",  # transformers' saved name
     lambda c: c.update(linear_lower_bound=-5.0)),
    ("unknown_key", r"linear_attn_config has keys \['chunk_size'\] that Weir's Kimi Linear does not know",
     lambda c: c["linear_attn_config"].update(chunk_size=32)),
    ("rope_mla", r"mla_use_nope=false \(RoPE on the MLA layers\)", lambda c: c.update(mla_use_nope=False)),
    ("softmax_router", r"moe_router_activation_func='softmax' is not supported",
     lambda c: c.update(moe_router_activation_func="softmax")),
    ("moe_freq", r"moe_layer_freq=2 is not supported", lambda c: c.update(moe_layer_freq=2)),
    ("overlap", r"layers \[4\] are in both", lambda c: c["linear_attn_config"]["kda_layers"].append(4)),
    # transformers itself refuses a gap when it derives layer_types; given layer_types, it would not.
    ("gap", r"\[27\] in neither", lambda c: c.update(layer_types=["linear_attention"] * 27) or c[
        "linear_attn_config"].update(full_attn_layers=[4, 8, 12, 16, 20, 24])),
    ("zero_indexed", r"full_attn_layers lists layers \[0\], outside 1\.\.27",
     lambda c: c["linear_attn_config"].update(full_attn_layers=[0, 4, 8, 12, 16, 20, 24])),
])
def test_configs_served_otherwise_are_refused_by_name(tmp_path, name, match, edit):
    _refused(tmp_path, name, match, edit)


def test_layer_types_that_disagree_with_the_lists_are_refused(tmp_path):
    def edit(config):
        config["layer_types"] = ["full_attention" if i % 4 == 0 and i else "linear_attention" for i in range(27)]

    _refused(tmp_path, "disagree", r"layer_types .* disagree with linear_attn_config", edit)


def test_a_layer_past_the_config_s_last_is_refused_not_dropped(checkpoint, tmp_path):
    """Kimi Linear declares no MTP layers: a config with fewer layers than its checkpoint must not
    serve the truncated model."""
    short = tmp_path / "short"
    shutil.copytree(checkpoint, short)
    config = json.loads((short / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    linear_attn_config = config["linear_attn_config"]
    for key in ("kda_layers", "full_attn_layers"):
        linear_attn_config[key] = [layer for layer in linear_attn_config[key] if layer < num_layers]
    config["num_hidden_layers"] = num_layers - 1
    (short / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"does not use.*model\.layers\.{num_layers - 1}\."):
        LLM(str(short), device="cpu", dtype="float32", skip_tokenizer_init=True)


def test_served_with_token_ids_only(checkpoint, references, tmp_path):
    """No Kimi tokenizer can be had: the engine serves token-id prompts without one."""
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    prompts, expected = references
    llm = LLM(str(bare), device="cpu", dtype="float32", skip_tokenizer_init=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens[:8] for tokens, _ in expected[:2]]


def test_weir_testing_check_model_passes_kimi_linear(checkpoint):
    from weir.testing import check_model

    check_model(checkpoint, num_tokens=8, max_num_batched_tokens=16)


def test_q_lora_and_two_shared_experts_match_transformers(tmp_path):
    """The MLA variant with a q LoRA (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) and a shared
    MLP twice an expert's width, split into two shared experts; the first two layers dense."""
    path = make_tiny_kimi_linear(tmp_path / "q_lora", with_tokenizer=True, q_lora_rank=24, n_shared_experts=2,
                                 first_k_dense_replace=2, seed=1)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(length)] for length in (6, 33, 70)]
    expected = transformers_greedy(path, prompts, NUM_TOKENS)
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=32)
    layers = llm.engine.runner.model.model.layers
    assert [layer.feed_forward_name for layer in layers] == ["mlp", "mlp", "block_sparse_moe", "block_sparse_moe",
                                                             "block_sparse_moe"]
    assert layers[2].block_sparse_moe.experts.num_shared_experts == 2
    watch = watch_engine(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert_matches(watch, outputs, expected)


def test_dummy_weights_serve(checkpoint, tmp_path):
    """``--load-format dummy`` (how the 48B model is benchmarked): random weights, finite logits."""
    bare = tmp_path / "config_only"
    bare.mkdir()
    shutil.copy(checkpoint / "config.json", bare / "config.json")
    llm = LLM(str(bare), device="cpu", dtype="float32", load_format="dummy", skip_tokenizer_init=True)
    watch = watch_engine(llm)
    output = llm.generate([{"prompt_token_ids": list(range(40))}],
                          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4
    assert all(torch.isfinite(logits).all() for logits in watch.logits[output.request_id])
