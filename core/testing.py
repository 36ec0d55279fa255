"""Conformance checks for third-party plugins: run one against a reference.

    from weir.testing import check_linear_attention_backend, check_model, check_moe_backend
    check_model("path/to/tiny-checkpoint")                 # a model plugin against transformers
    check_moe_backend(MyMoEBackend())                      # raises AssertionError naming the case
    check_linear_attention_backend(MyGDNBackend, device="cuda", dtype=torch.bfloat16)
    check_linear_attention_backend(MyKDABackend)           # a Kimi Delta Attention backend, likewise

``check_model`` serves prompts of several lengths through ``weir.LLM`` (greedy, with the chosen
tokens' logprobs) and compares them with transformers' own model run in a subprocess
(``transformers_greedy``). The backend checks feed the backend and the reference
(``weir.plugins.moe_backends.torch_ref``; ``weir.plugins.attention.gdn_torch`` or ``kda_torch``
by the layer kind a linear-attention backend serves) the same random inputs over the cases the
engine produces (every routing method of ``weir.moe.Routing``, shared experts gated and not;
prefill, chunked and mixed steps, decodes, a CUDA-graph padding request on the padding slot) and
compares outputs and state slots. Tolerances: elementwise 1e-4 (relative, and
absolute times the largest value) for float32; for 16-bit dtypes, where fast kernels round and
sum in other orders, 2% relative error in norm.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from weir.linear_attention import (
    GATED_DELTA_NET,
    KIMI_DELTA_ATTENTION,
    GatedDeltaNetLayerSpec,
    KimiDeltaAttentionLayerSpec,
    LinearAttentionBackend,
    LinearAttentionMetadata,
)
from weir.moe import MoEBackend, Routing

# transformers swaps in fla's Triton kernels for Gated DeltaNet (and Dao's conv / mamba kernels)
# whenever they import: the reference would then be those kernels, and on CPU tensors they fail.
# The reference process hides them before transformers is imported.
_REFERENCE_BLOCKED = ("fla", "causal_conv1d", "mamba_ssm")
_REFERENCE_PROGRAM = """
import json, sys
import torch
for name in {blocked!r}:
    sys.modules[name] = None
from transformers import AutoModelForCausalLM

request = json.load(open(sys.argv[1]))
device = request["device"]
model = AutoModelForCausalLM.from_pretrained(request["model"], dtype=getattr(torch, request["dtype"])).to(device)
results = []
with torch.no_grad():
    for prompt in request["prompts"]:
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        tokens, logits = [], []
        for _ in range(request["num_tokens"]):
            step_logits = out.logits[0, -1].float()
            logits.append(step_logits.cpu())
            tokens.append(int(step_logits.argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
        results.append((tokens, torch.stack(logits)))
torch.save(results, sys.argv[2])
""".format(blocked=_REFERENCE_BLOCKED)


class MoECase(NamedTuple):
    """One layer call of ``check_moe_backend``: shared experts follow the routed ones, weighted by
    ``sigmoid(gate logit)`` when ``shared_gated`` (Qwen3-Next) or by 1 (DeepSeek)."""

    num_tokens: int
    routing: Routing
    num_shared: int
    shared_gated: bool
    activation: str


# Every routing method with and without shared experts; decode-size batches, and ones of ~40-100
# rows per expert, where fused kernels switch to their prefill tiles.
MOE_CASES = (
    MoECase(1, Routing.softmax_top_k(8, 2, renormalize=True), 0, False, "silu"),
    MoECase(7, Routing.softmax_top_k(8, 2, renormalize=False), 1, True, "silu"),
    MoECase(33, Routing.softmax_top_k(16, 4, renormalize=True), 1, True, "silu"),
    MoECase(5, Routing.softmax_top_k(4, 4, renormalize=True), 0, False, "gelu"),
    MoECase(400, Routing.softmax_top_k(8, 2, renormalize=True), 1, True, "silu"),
    MoECase(9, Routing.top_k_softmax(8, 2), 0, False, "silu"),
    MoECase(19, Routing.top_k_softmax(6, 3), 1, False, "gelu_pytorch_tanh"),
    MoECase(150, Routing.top_k_softmax(8, 2), 0, False, "silu"),
    # DeepSeek-V3 shaped (groups, renormalised, scaled, one ungated shared expert), then Kimi
    # Linear shaped (one group), then a prefill-size batch with two shared experts.
    MoECase(13, Routing.sigmoid_grouped_top_k(16, 4, num_groups=4, top_k_groups=2, renormalize=True,
                                              routed_scaling_factor=2.5), 1, False, "silu"),
    MoECase(6, Routing.sigmoid_grouped_top_k(8, 3, num_groups=1, top_k_groups=1, renormalize=False,
                                             routed_scaling_factor=1.5), 0, False, "silu"),
    MoECase(300, Routing.sigmoid_grouped_top_k(32, 4, num_groups=8, top_k_groups=3, renormalize=True,
                                               routed_scaling_factor=2.0), 2, False, "silu"),
)

GDN_LAYERS = (
    GatedDeltaNetLayerSpec(layer_idx=0, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel=4),
    # Non-power-of-two head dims, one q/k head for three value heads, a 3-tap conv.
    GatedDeltaNetLayerSpec(layer_idx=1, num_k_heads=1, num_v_heads=3, head_k_dim=12, head_v_dim=20, conv_kernel=3),
)
KDA_LAYERS = (
    KimiDeltaAttentionLayerSpec(layer_idx=0, num_heads=2, head_dim=16, conv_kernel=4),
    # A non-power-of-two head dim, three heads, a 3-tap conv.
    KimiDeltaAttentionLayerSpec(layer_idx=1, num_heads=3, head_dim=12, conv_kernel=3),
)
NUM_SLOTS = 6  # slots 0..5 for requests; slot 6 is the padding slot
# Steps of three requests on scattered slots: (query lengths, slots). The first prompt spans
# several chunks of chunked kernels (fla's are 64 tokens). Decode-only steps carry no host copy
# of the request starts, as inside a CUDA graph; the last adds a CUDA-graph padding request on
# the padding slot, whose output and slot are not compared.
GDN_STEPS = (
    ((150, 1, 9), (2, 0, 5)),  # prefill, one of them a single token
    ((1, 1, 4), (2, 0, 5)),  # two decodes ahead of a chunk: a mixed step
    ((1, 1, 1), (2, 0, 5)),  # decodes
    ((1, 1, 1, 1), (2, 0, 5, NUM_SLOTS)),  # decodes plus a padding request
)


def transformers_greedy(model_path: str | Path, prompts: list[list[int]], num_tokens: int, device: str = "cpu",
                        dtype: str = "float32") -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy continuation of each prompt, EOS ignored: ``[(tokens, logits
    [num_tokens, vocab] fp32 on the CPU)]``, computed in a subprocess with fla and Dao's kernels
    hidden (``_REFERENCE_BLOCKED``) so that the reference is transformers' torch code."""
    with tempfile.TemporaryDirectory() as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.pt"
        request.write_text(json.dumps({"model": str(model_path), "prompts": prompts, "num_tokens": num_tokens,
                                       "device": device, "dtype": dtype}))
        completed = subprocess.run([sys.executable, "-c", _REFERENCE_PROGRAM, str(request), str(result)],
                                   capture_output=True, text=True, timeout=1800)
        if completed.returncode != 0:
            raise RuntimeError(f"the transformers reference failed on {model_path}:\n{completed.stderr[-6000:]}")
        return torch.load(result)


def check_model(model_path: str | Path, prompts: list[list[int]] | None = None, num_tokens: int = 16,
                **engine_options: Any) -> None:
    """Weir's greedy tokens, and the logprob of each, against transformers on the same checkpoint
    (float32 on the CPU unless ``engine_options`` say otherwise; use a tiny random checkpoint).

    ``prompts`` default to token ids of lengths 3, 17 and 40 (from a fixed seed), so the model's
    context must hold 40 + ``num_tokens``; pass ``max_num_batched_tokens=16`` to push them through
    chunked prefill as well. The folder needs a tokenizer, as for any Weir run (``tokenizer=`` may
    name another folder). Tokens must be equal; each logprob within 1e-3 of transformers' (float32
    differences are ~1e-6).
    """
    from weir import LLM, SamplingParams

    llm = LLM(str(model_path), **{"device": "cpu", "dtype": "float32", **engine_options})
    engine = llm.llm_engine
    if prompts is None:
        generator = torch.Generator().manual_seed(0)
        vocab_size = engine.config.model.hf_config.vocab_size
        prompts = [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    references = transformers_greedy(model_path, prompts, num_tokens, device=str(engine.runner.device),
                                     dtype=str(engine.config.model.dtype).removeprefix("torch."))
    for prompt_index, (output, (expected_tokens, expected_logits)) in enumerate(zip(outputs, references)):
        completion = output.outputs[0]
        where = f"{model_path}, prompt {prompt_index} ({len(prompts[prompt_index])} tokens)"
        expected_logprobs = torch.log_softmax(expected_logits, dim=-1)  # [num_tokens, vocab]
        for step, expected_token in enumerate(expected_tokens):  # the first difference is the one reported
            token = completion.token_ids[step] if step < len(completion.token_ids) else None
            if token != expected_token:
                raise AssertionError(f"{where}: greedy tokens differ from transformers' at step {step}: "
                                     f"{completion.token_ids[step:step + 5]} vs {expected_tokens[step:step + 5]}")
            difference = abs(completion.logprobs[step][token].logprob - expected_logprobs[step, token].item())
            if not difference <= 1e-3:
                raise AssertionError(f"{where}: the logprob of token {token} at step {step} differs from "
                                     f"transformers' by {difference:.3g}")


def check_moe_backend(backend: MoEBackend, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      seed: int = 0) -> None:
    """``backend.forward`` against the torch reference over ``MOE_CASES``: every routing method,
    routed-only and shared-expert layers. Router logits are distinct within each row (a tie at
    the top-k boundary may go either way, ``weir.moe.Routing``); the correction bias is fp32."""
    from weir.plugins.moe_backends.torch_ref import TorchMoEBackend

    reference = TorchMoEBackend()
    generator = torch.Generator().manual_seed(seed)
    for case in MOE_CASES:
        num_routed, num_shared = case.routing.num_experts, case.num_shared
        num_experts, hidden_size, intermediate = num_routed + num_shared, 32, 24

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

        hidden = randn(case.num_tokens, hidden_size)
        # Column slices of one wider output, as a model's merged router GEMM hands them over.
        router_width = num_experts + 3
        ranks = torch.argsort(torch.rand(case.num_tokens, router_width, generator=generator), dim=1)
        router_output = (ranks * (6 / router_width) - 3).to(device=device, dtype=dtype)  # distinct in [-3, 3)
        router_logits = router_output[:, :num_routed]
        w_gate_up = randn(num_experts, 2 * intermediate, hidden_size, scale=hidden_size ** -0.5)
        w_down = randn(num_experts, hidden_size, intermediate, scale=intermediate ** -0.5)
        options: dict[str, Any] = dict(routing=case.routing, activation=case.activation,
                                       num_shared_experts=num_shared)
        if case.shared_gated:
            options["shared_gate_logits"] = router_output[:, num_routed:num_routed + num_shared]
        if case.routing.uses_correction_bias:
            # As large as the sigmoid scores' spread, so that it changes which experts are chosen.
            options["correction_bias"] = (torch.randn(num_routed, generator=generator) * 0.5).to(device)
        actual = backend.forward(hidden, router_logits, w_gate_up, w_down, **options)
        expected = reference.forward(hidden, router_logits, w_gate_up, w_down, **options)
        _assert_close(actual, expected, dtype, f"MoE backend {backend.name!r}, {case}")


class _LinearAttentionKind(NamedTuple):
    """What ``check_linear_attention_backend`` runs a backend of one state kind with."""

    layers: tuple
    reference: str  # "module:Class" of the torch reference backend
    decay_shape: Any  # layer -> the per-token shape of g (after the token dim)
    beta_heads: Any  # layer -> the heads of beta


_LINEAR_ATTENTION_KINDS = {
    GATED_DELTA_NET: _LinearAttentionKind(
        GDN_LAYERS, "weir.plugins.attention.gdn_torch:TorchGDNBackend",
        lambda layer: (layer.num_v_heads,), lambda layer: layer.num_v_heads),
    KIMI_DELTA_ATTENTION: _LinearAttentionKind(
        KDA_LAYERS, "weir.plugins.attention.kda_torch:TorchKDABackend",
        lambda layer: (layer.num_heads, layer.head_dim), lambda layer: layer.num_heads),
}


def check_linear_attention_backend(
    backend_cls: type[LinearAttentionBackend],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    """A Gated DeltaNet or Kimi Delta Attention backend (each kind of ``supported_layer_kinds``)
    against its torch reference over prefill, mixed and decode steps (``GDN_STEPS``), from the
    same non-zero states: outputs, the used slots after every step, and the untouched slots
    (which must not change)."""
    kinds = sorted(set(backend_cls.supported_layer_kinds) & set(_LINEAR_ATTENTION_KINDS))
    if not kinds:
        served = sorted(backend_cls.supported_layer_kinds)
        raise ValueError(f"backend {backend_cls.name!r} serves layer kinds {served}; this check knows "
                         f"{sorted(_LINEAR_ATTENTION_KINDS)}")
    for kind in kinds:
        _check_linear_attention_kind(backend_cls, _LINEAR_ATTENTION_KINDS[kind], torch.device(device), dtype,
                                     state_dtype, seed)


def _check_linear_attention_kind(backend_cls: type[LinearAttentionBackend], kind: _LinearAttentionKind,
                                 device: torch.device, dtype: torch.dtype, state_dtype: torch.dtype,
                                 seed: int) -> None:
    import importlib

    module_name, _, class_name = kind.reference.partition(":")
    reference_cls = getattr(importlib.import_module(module_name), class_name)
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, out_dtype=dtype):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=out_dtype)

    for layer in kind.layers:
        backends = [backend_cls(dtype, device, state_dtype), reference_cls(dtype, device, state_dtype)]
        states = [backend.allocate_state(NUM_SLOTS, layer) for backend in backends]
        initial_conv = randn(*states[1].conv_state.shape, out_dtype=states[1].conv_state.dtype)
        initial_recurrent = randn(*states[1].recurrent_state.shape, scale=0.3, out_dtype=state_dtype)
        for state in states:  # earlier tokens' state, as a request resumed mid-prompt has
            state.conv_state.copy_(initial_conv)
            state.recurrent_state.copy_(initial_recurrent)
        conv_weight = randn(layer.conv_dim, layer.conv_kernel, scale=0.5)
        beta_heads = kind.beta_heads(layer)
        for step, (query_lens, slots) in enumerate(GDN_STEPS):
            num_tokens = sum(query_lens)
            # Rows strided, as the model's merged input projection hands them over.
            mixed_qkv = randn(num_tokens, layer.conv_dim + 2 * beta_heads)[:, :layer.conv_dim]
            log_decay = randn(num_tokens, *kind.decay_shape(layer), out_dtype=torch.float32)
            g = -torch.nn.functional.softplus(log_decay) * 0.5
            beta = torch.sigmoid(randn(num_tokens, beta_heads, out_dtype=torch.float32)).to(dtype)
            outputs = [backend.forward(layer, mixed_qkv, g, beta, conv_weight, state,
                                       backend.build_metadata(_step_metadata(query_lens, slots, device)))
                       for backend, state in zip(backends, states)]
            where = f"linear-attention backend {backend_cls.name!r}, layer {layer}, step {step} {query_lens}"
            real_rows = sum(length for length, slot in zip(query_lens, slots) if slot != NUM_SLOTS)
            _assert_close(outputs[0][:real_rows], outputs[1][:real_rows], dtype, where + ": output")
            used = sorted({slot for slot in slots if slot != NUM_SLOTS})
            _assert_close(states[0].recurrent_state[used], states[1].recurrent_state[used], dtype,
                          where + ": recurrent state of the used slots")
            _assert_close(states[0].conv_state[used], states[1].conv_state[used], dtype, where + ": conv windows")
        untouched = [slot for slot in range(NUM_SLOTS) if all(slot not in slots for _, slots in GDN_STEPS)]
        for name in ("conv_state", "recurrent_state"):
            if not torch.equal(getattr(states[0], name)[untouched],
                               getattr(states[1], name)[untouched]):
                raise AssertionError(f"linear-attention backend {backend_cls.name!r} changed the {name} of "
                                     f"slots {untouched}, which no request used")


def _step_metadata(query_lens: tuple[int, ...], slots: tuple[int, ...], device: torch.device
                   ) -> LinearAttentionMetadata:
    query_start_loc_cpu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    decode_only = max(query_lens) == 1  # a step a CUDA graph may replay: no host values
    return LinearAttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device),
        state_indices=torch.tensor(slots, dtype=torch.int32, device=device),
        num_reqs=len(query_lens), num_tokens=sum(query_lens), max_query_len=max(query_lens),
        query_start_loc_cpu=None if decode_only else query_start_loc_cpu,
    )


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, model_dtype: torch.dtype, where: str) -> None:
    """Elementwise to 1e-4 when the model and the compared tensor are fp32; otherwise within 2% in
    norm, as 16-bit inputs allow (an fp32 recurrent state fed bf16 q, k and v carries bf16 error)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{where}: got {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} "
                             f"{tuple(expected.shape)}")
    if expected.dtype != torch.float32 or model_dtype != torch.float32:
        error = (actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)
        if not error <= 2e-2:  # also catches NaN
            raise AssertionError(f"{where}: relative error {error.item():.3g} in norm (at most 0.02)")
        return
    scale = max(1.0, expected.abs().amax().item())
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale)
    except AssertionError as error:
        raise AssertionError(f"{where}: {error}") from None

