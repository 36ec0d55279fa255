"""Qwen3-Next against transformers, fp32 on the CPU (``weir.testing.transformers_greedy`` runs
transformers with fla blocked, so its torch Gated DeltaNet is the reference): logits and 32 greedy tokens for 8
prompts of different lengths, through chunked prefill (state carried across chunks), preemption,
too few state slots, and both scheduling modes (prefix caching on, as by default, though these
prompts share nothing); plus the checkpoint layouts the loader must take
and the errors for broken ones."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from helpers_models import make_tiny_qwen3_next
from engine_harness import assert_nothing_held, watch_engine
from weir.testing import transformers_greedy
from weir import LLM, SamplingParams

pytestmark = pytest.mark.integration

NUM_TOKENS = 32
PROMPT_LENGTHS = (1, 3, 9, 17, 24, 40, 55, 70)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3_next"), with_tokenizer=True)


@pytest.fixture(scope="module")
def references(checkpoint):
    path = checkpoint
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(length)] for length in PROMPT_LENGTHS]
    # In a child process with fla blocked: on a machine with fla, transformers would use it.
    return prompts, transformers_greedy(path, prompts, NUM_TOKENS)


def kv_bytes_for_blocks(num_blocks: int, block_size: int) -> int:
    # Two full-attention layers of 2 KV heads x 32 dims in fp32 (the DeltaNet layers hold no KV).
    return num_blocks * 2 * block_size * 2 * 32 * 4 * 2


SCENARIOS = {
    "plain": {},
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(block_size=4, max_model_len=128, kv_cache_memory_bytes=kv_bytes_for_blocks(41, 4)),
    "few_state_slots": {},  # memory for 2 state slots only: 8 requests take turns
}
# Both scheduling modes where state crosses steps in interesting ways; one mode elsewhere (CI time).
RUNS = [("plain", True), ("chunked_prefill", True), ("chunked_prefill", False), ("preemption", True),
        ("preemption", False), ("few_state_slots", True)]


@pytest.mark.parametrize("scenario,async_scheduling", RUNS)
def test_matches_transformers(checkpoint, references, scenario, async_scheduling, monkeypatch, caplog):
    from weir.runner.model_runner import ModelRunner

    path = checkpoint
    prompts, expected = references
    if scenario == "few_state_slots":  # room for 3 slots' state: 2 slots plus the padding slot
        monkeypatch.setattr(ModelRunner, "_state_room_bytes",
                            lambda self: 2 * 3 * sum(self.caches.backend_of(layer).state_bytes_per_slot(layer)
                                                     for layer in self.caches.state_layers))
    llm = LLM(str(path), device="cpu", dtype="float32", async_scheduling=async_scheduling, **SCENARIOS[scenario])
    watch = watch_engine(llm)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    engine = llm.engine
    assert engine.runner.caches.backends["gated_delta_net"].name == "gdn_torch"
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if scenario == "chunked_prefill":
        assert watch.num_steps > NUM_TOKENS + 70 // 16  # prompts needed several chunks
    if scenario == "few_state_slots":
        assert engine.scheduler.kv_cache.state_slots.num_slots == 2
        assert "2 state slots, so at most 2 requests run at once" in caplog.text
    for output, (expected_tokens, expected_logits) in zip(outputs, expected):
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens
        logits = torch.stack(watch.logits[output.request_id][:NUM_TOKENS])
        rel_err = ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item()
        assert rel_err < 1e-4, f"request {output.request_id}: max relative error {rel_err:.2e}"
    assert_nothing_held(llm)


def test_shared_expert_fused_or_not_matches_transformers(checkpoint, references, tmp_path):
    """A shared expert as wide as a routed one runs as one more fused expert; a wider one stays
    a separate MLP. Both match transformers (the router and its gate are one GEMM either way)."""
    from weir.layers.moe import FusedExperts

    llm = LLM(str(checkpoint), device="cpu", dtype="float32")
    blocks = [layer.mlp for layer in llm.engine.runner.model.model.layers if hasattr(layer.mlp, "experts")]
    assert blocks and all(block.shared_expert is None and block.experts.num_shared_experts == 1 for block in blocks)
    assert all(block.experts.gate_up_proj.shape[0] == 9 for block in blocks)  # 8 routed + 1 shared

    wider = make_tiny_qwen3_next(tmp_path / "wider", with_tokenizer=True, shared_expert_intermediate_size=48)
    rng = random.Random(1)
    prompts = [[rng.randrange(0, 256) for _ in range(length)] for length in (5, 30)]
    expected = transformers_greedy(wider, prompts, NUM_TOKENS)
    llm = LLM(str(wider), device="cpu", dtype="float32")
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.num_shared_experts == 0 for m in experts)
    watch = watch_engine(llm)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, (expected_tokens, expected_logits) in zip(outputs, expected):
        assert output.outputs[0].token_ids == expected_tokens
        logits = torch.stack(watch.logits[output.request_id][:NUM_TOKENS])
        assert ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item() < 1e-4


def test_prefix_caching_is_on_and_says_so(checkpoint, references, caplog):
    """The same long prompt twice, one after the other: the second resumes its DeltaNet layers
    from the first's state checkpoint at its last block boundary (more in test_hybrid_prefix_cache)."""
    path = checkpoint
    prompts, expected = references
    with caplog.at_level(logging.INFO, logger="weir.engine"):
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, enable_prefix_caching=True)
    assert "prefix caching: on for Qwen3NextForCausalLM (hybrid)" in caplog.text
    assert "retention interval 0" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = [llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outputs] == [0, 68]  # 70 tokens: the boundary before the last is 68
    assert [o.outputs[0].token_ids for o in outputs] == [expected[-1][0]] * 2


def test_aborted_requests_give_back_their_slots(checkpoint, references):
    path = checkpoint
    prompts, _ = references
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=4)
    engine = llm.engine
    for index, prompt in enumerate(prompts[:4]):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv_cache.state_slots.num_free == 0
    engine.abort_request(["r0", "r2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(llm)


def _fused_expert_checkpoint(source, destination):
    """The same weights with transformers' fused in-memory expert layout (no per-expert tensors)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, destination)
    weights = load_file(str(source / "model.safetensors"))
    fused = {}
    for name, tensor in weights.items():
        if ".experts." not in name:
            fused[name] = tensor
    for layer in range(1, 4):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([weights[f"{prefix}.{e}.gate_proj.weight"], weights[f"{prefix}.{e}.up_proj.weight"]])
                   for e in range(8)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack([weights[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    save_file(fused, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def test_fused_expert_layout_loads(checkpoint, references, tmp_path):
    path = checkpoint
    prompts, expected = references
    fused_path = _fused_expert_checkpoint(path, tmp_path / "fused")
    llm = LLM(str(fused_path), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == expected[4][0]


def test_missing_expert_is_named(checkpoint, tmp_path):
    def drop(weights):
        del weights["model.layers.3.mlp.experts.5.up_proj.weight"]

    broken = _rewritten_checkpoint(checkpoint, tmp_path / "broken", drop)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*: model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight$"):
        LLM(str(broken), device="cpu", dtype="float32")


def _rewritten_checkpoint(source, destination, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, destination)
    weights = load_file(str(source / "model.safetensors"))
    edit(weights)
    save_file(weights, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def test_expert_outside_the_config_is_named(checkpoint, tmp_path):
    def add_expert(weights):
        prefix = "model.layers.1.mlp.experts"
        weights[f"{prefix}.9.up_proj.weight"] = weights[f"{prefix}.0.up_proj.weight"].clone()

    broken = _rewritten_checkpoint(checkpoint, tmp_path / "extra", add_expert)
    with pytest.raises(ValueError, match=r"experts\.9\.up_proj\.weight maps to shard 'up\.9'.*16: gate\.0 \.\.\. up\.7"):
        LLM(str(broken), device="cpu", dtype="float32")


def test_fused_expert_tensor_of_the_wrong_shape_is_named(checkpoint, tmp_path):
    fused = _fused_expert_checkpoint(checkpoint, tmp_path / "fused")

    def truncate(weights):
        weights["model.layers.2.mlp.experts.down_proj"] = weights["model.layers.2.mlp.experts.down_proj"][:7]

    broken = _rewritten_checkpoint(fused, tmp_path / "broken", truncate)
    with pytest.raises(ValueError, match=r"experts\.down_proj has shape \(7, 64, 32\).*expects \(8, 64, 32\)"):
        LLM(str(broken), device="cpu", dtype="float32")


def test_decoder_sparse_step_of_zero_is_named(checkpoint, tmp_path):
    import json
    import shutil

    broken = shutil.copytree(checkpoint, tmp_path / "sparse_step")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "decoder_sparse_step": 0}))
    with pytest.raises(ValueError, match="decoder_sparse_step in the config must be an integer >= 1"):
        LLM(str(broken), device="cpu", dtype="float32")


def test_dense_models_need_no_moe_backend(tiny_llama_path, monkeypatch):
    monkeypatch.setenv("WEIR_PLUGINS", "builtin_platforms,builtin_models,builtin_attention")
    llm = LLM(str(tiny_llama_path), device="cpu", dtype="float32", max_model_len=64)
    assert llm.engine.runner.moe_backend is None


def test_16bit_recurrent_state(checkpoint, references):
    """``linear_state_dtype="bfloat16"`` stores the recurrent states rounded (half the bytes); the
    maths stays fp32, so the results stay close to the fp32 reference."""
    prompts, expected = references
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", linear_state_dtype="bfloat16")
    states = [state for state in llm.engine.runner.caches.layer_states if state is not None]
    assert states and all(state.recurrent_state.dtype == torch.bfloat16 for state in states)
    assert all(state.conv_state.dtype == torch.float32 for state in states)  # the model dtype
    watch = watch_engine(llm)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, (expected_tokens, expected_logits) in zip(outputs, expected):
        logits = torch.stack(watch.logits[output.request_id][:4])
        rel_err = ((logits - expected_logits[:4]).abs().max() / expected_logits.abs().max()).item()
        assert 0 < rel_err < 2e-2, f"request {output.request_id}: {rel_err:.1e}"
        assert output.outputs[0].token_ids[:4] == expected_tokens[:4]
    assert_nothing_held(llm)
    with pytest.raises(ValueError, match="linear_state_dtype must be one of"):
        LLM(str(checkpoint), device="cpu", linear_state_dtype="int8")


def test_served_over_http_with_concurrent_streams(checkpoint, references):
    """Qwen3-Next behind the OpenAI server: eight concurrent streamed completions (more than the
    three state slots, so some wait for one) each give the text of the reference's greedy tokens
    (as Weir's detokenizer renders them offline)."""
    import concurrent.futures

    import openai

    from server_inprocess import serve_in_thread

    prompts, expected = references
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = LLM(str(checkpoint), device="cpu", max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in offline] == [tokens[:8] for tokens, _ in expected]
    with serve_in_thread(checkpoint, max_num_seqs=3) as (port, _, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=120)

        def stream(prompt_ids):
            chunks = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=8, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(stream, prompts))
    assert texts == [o.outputs[0].text for o in offline]


def test_a_linear_attention_backend_output_of_the_wrong_shape_is_named(checkpoint):
    """A third-party DeltaNet backend that returns ``[T, HV * Dv]`` fails at its layer, by name,
    instead of inside the gated norm with a size mismatch."""
    from transformers import AutoConfig

    from weir.layer_cache import ForwardContext, LayerContext
    from weir.plugins.models.qwen3_next import GatedDeltaNet

    class Flattened:
        name = "flattened"

        def forward(self, layer, mixed_qkv, g, beta, conv_weight, state, metadata):
            return mixed_qkv.new_zeros(mixed_qkv.shape[0], layer.value_dim)

    layer = GatedDeltaNet(AutoConfig.from_pretrained(checkpoint), layer_idx=0)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    ctx = ForwardContext([LayerContext(Flattened(), None, None)])
    with pytest.raises(RuntimeError, match=r"linear-attention backend 'flattened' returned torch.float32 \(3, 64\); "
                                           r"expected torch.float32 \(3, 4, 16\)"):
        layer(torch.arange(3), torch.randn(3, layer.in_proj.weight.shape[1]), ctx)


def test_no_room_for_state_on_the_cpu_gives_advice_that_applies_there(checkpoint, monkeypatch):
    from weir.plugins.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "memory_info", lambda self: (40_000, 10**9))  # 40 kB available
    with pytest.raises(ValueError, match=r"no room for linear-attention state.*free host memory: on the CPU the "
                                         r"state slots come out of the default cache allowance.*at most 40% of the available RAM"):
        LLM(str(checkpoint), device="cpu", kv_cache_memory_bytes=10**8)


def test_long_max_model_len_takes_state_slots_rather_than_failing(checkpoint, monkeypatch):
    """The state slots are sized after setting aside the KV cache of one request of max_model_len:
    with room for eight slots in half of the allowance, but then too little KV cache left for one
    request of 512 tokens, the engine starts with fewer slots instead (Kimi Linear's 1M default)."""
    from weir.plugins.platforms.cpu import CpuPlatform
    from weir.runner.kv_sizing import one_request_kv_bytes

    probe = LLM(str(checkpoint), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=512)
    per_slot, one_request = probe.engine.runner.linear_state.bytes_per_slot, one_request_kv_bytes(probe.engine.runner)
    del probe
    assert one_request >= 20 * per_slot  # so that half the allowance below holds 8 slots and the padding one
    # Eight slots and the padding one (9 x per_slot) would leave one_request - per_slot: too little.
    allowance = one_request + 8 * per_slot
    monkeypatch.setattr(CpuPlatform, "default_kv_cache_bytes", lambda self, weight_bytes: allowance)
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=512)
    runner = llm.engine.runner
    assert runner.num_state_slots == 3  # half of the 8 slots' worth left after one request's KV, less the padding slot
    # No more requests run than slots: the request table and the sampler have that many rows
    # (the 5 prompts below take turns in them).
    assert runner.table.max_num_reqs == runner.sampler.states.max_num_reqs == 3
    assert (runner.num_blocks[0] - 1) * runner.block_size >= 512
    prompts = [{"prompt_token_ids": [5 + i] * (100 + 50 * i)} for i in range(5)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4] * 5


def test_a_max_model_len_past_the_memory_fails_at_kv_sizing_with_what_fits(checkpoint, monkeypatch):
    """One request's KV cache larger than the room left: the engine keeps one state slot, so the
    start-up fails at KV sizing, whose error names max_model_len and what of it fits (not the
    state's "no room" error, whose remedy would not help)."""
    from weir.plugins.platforms.cpu import CpuPlatform
    from weir.runner.kv_sizing import one_request_kv_bytes

    probe = LLM(str(checkpoint), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=512)
    one_request = one_request_kv_bytes(probe.engine.runner)
    del probe
    monkeypatch.setattr(CpuPlatform, "default_kv_cache_bytes", lambda self, weight_bytes: one_request // 2)
    with pytest.raises(ValueError, match=r"fewer than one request of max_model_len=512 needs \(32\) "
                                         r"\(about max_model_len=\d+ fits\)"):
        LLM(str(checkpoint), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=512)


def test_kv_cache_memory_bytes_on_the_cpu_is_not_drawn_from_the_state_allowance(checkpoint):
    """On the CPU an explicit KV size comes on top of the default allowance the state slots draw
    from: a KV cache larger than that allowance leaves every slot in place."""
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=600 * 2**20)
    assert llm.engine.runner.num_state_slots == 8
    outputs = llm.generate([{"prompt_token_ids": [7] * 20}], SamplingParams(temperature=0, max_tokens=3,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
