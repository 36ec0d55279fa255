"""Tiny random Hugging Face checkpoints (and a tokenizer) for tests.

Each ``make_tiny_*`` builds a transformers model from a small config with a fixed seed and
``save_pretrained``s it, so tests exercise Weir's loader on the real checkpoint layout and
compare against transformers as the reference. Norm weights and biases are randomised too (HF
initialises them to ones/zeros, which would hide a swapped q_norm/k_norm or a dropped bias).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Special-token ids shared by the tiny configs and save_tiny_tokenizer (after the 256 byte tokens).
TINY_BOS_ID, TINY_EOS_ID, TINY_PAD_ID = 256, 257, 258
TINY_VOCAB_SIZE = 320

# rope_parameters variants (rope_theta is added by _rope); None = plain RoPE.
ROPE_VARIANTS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
}

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.1, bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    pad_token_id=TINY_PAD_ID,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _rope(variant: dict[str, Any] | None, rope_theta: float) -> dict[str, Any]:
    params = {"rope_type": "default"} if variant is None else dict(variant)
    params.setdefault("rope_theta", rope_theta)
    return params


@torch.no_grad()
def _save_random(config: Any, path: Path, seed: int, with_tokenizer: bool,
                 random_buffers: tuple[str, ...] = ()) -> Path:
    """``random_buffers``: name suffixes of saved buffers to randomise too (std 0.1), such as
    DeepSeek's ``e_score_correction_bias``, which transformers initialises to zeros."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if param.ndim == 1:  # norms around 1, biases around 0
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name else 0.0))
    for name, buffer in model.named_buffers():
        if random_buffers and name.endswith(random_buffers):
            buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.save_pretrained(path)
    if with_tokenizer:
        save_tiny_tokenizer(path, config.vocab_size)
    return path


def make_tiny_llama(path: Path, *, rope: str | dict | None = "default", seed: int = 0,
                    with_tokenizer: bool = False, **overrides: Any) -> Path:
    """Llama: head_dim = hidden/heads = 16. ``rope``: a ROPE_VARIANTS name or a rope_parameters dict."""
    from transformers import LlamaConfig

    variant = ROPE_VARIANTS[rope] if isinstance(rope, str) else rope
    options = {**_COMMON, "rope_parameters": _rope(variant, 10000.0), "tie_word_embeddings": False,
               "architectures": ["LlamaForCausalLM"], **overrides}
    return _save_random(LlamaConfig(**options), path, seed, with_tokenizer)


def tiny_qwen3_config(rope: str | dict | None = "default", **overrides: Any) -> Any:
    """Qwen3: explicit head_dim 32 (4 heads x 32 != hidden 64), tied embeddings, q/k norm."""
    from transformers import Qwen3Config

    variant = ROPE_VARIANTS[rope] if isinstance(rope, str) else rope
    return Qwen3Config(**{**_COMMON, "head_dim": 32, "rope_parameters": _rope(variant, 1000000.0),
                          "tie_word_embeddings": True, "architectures": ["Qwen3ForCausalLM"], **overrides})


def make_tiny_qwen3(path: Path, *, rope: str | dict | None = "default", seed: int = 0,
                    with_tokenizer: bool = False, **overrides: Any) -> Path:
    """The tiny Qwen3 of ``tiny_qwen3_config`` with random weights."""
    return _save_random(tiny_qwen3_config(rope, **overrides), path, seed, with_tokenizer)


def save_tiny_qwen3_config(path: Path) -> Path:
    """The tiny Qwen3's config.json and tokenizer without weights (for ``load_format="dummy"``)."""
    tiny_qwen3_config().save_pretrained(path)
    save_tiny_tokenizer(path)
    return Path(path)


def make_tiny_qwen2(path: Path, *, rope: str | dict | None = "default", seed: int = 0,
                    with_tokenizer: bool = False, **overrides: Any) -> Path:
    """Qwen2: q/k/v bias, no q/k norm, untied."""
    from transformers import Qwen2Config

    variant = ROPE_VARIANTS[rope] if isinstance(rope, str) else rope
    options = {**_COMMON, "rope_parameters": _rope(variant, 1000000.0), "tie_word_embeddings": False,
               "architectures": ["Qwen2ForCausalLM"], **overrides}
    return _save_random(Qwen2Config(**options), path, seed, with_tokenizer)


def make_tiny_mistral(path: Path, *, seed: int = 0, with_tokenizer: bool = False, **overrides: Any) -> Path:
    """Mistral: Llama's layers with one ``sliding_window`` for every layer (None by default)."""
    from transformers import MistralConfig

    options = {**_COMMON, "rope_parameters": _rope(None, 10000.0), "tie_word_embeddings": False,
               "architectures": ["MistralForCausalLM"], **overrides}
    return _save_random(MistralConfig(**options), path, seed, with_tokenizer)


def make_tiny_qwen3_next(path: Path, *, seed: int = 0, with_tokenizer: bool = False, **overrides: Any) -> Path:
    """Qwen3-Next: 4 layers (Gated DeltaNet, full, DeltaNet, full), GVA 2 key / 4 value heads,
    partial RoPE (8 of 32 dims), 8 experts top-2 plus a shared expert as wide as one (so Weir runs
    it among the experts, as for the released models); layer 0 has a dense MLP."""
    from transformers import Qwen3NextConfig

    options = {**_COMMON, "num_hidden_layers": 4, "head_dim": 32, "full_attention_interval": 2,
               "rope_parameters": _rope({"rope_type": "default", "partial_rotary_factor": 0.25}, 10000.0),
               "partial_rotary_factor": 0.25, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
               "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
               "mlp_only_layers": [0], "tie_word_embeddings": False,
               "architectures": ["Qwen3NextForCausalLM"], **overrides}
    return _save_random(Qwen3NextConfig(**options), path, seed, with_tokenizer)


_GRANITE_SWA = dict(
    num_hidden_layers=4, sliding_window=5,  # not a multiple of the tests' block sizes
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
    layer_rope_theta=[10000.0, 0, 500.0, 10000.0],  # two bases, and a layer without RoPE
    embedding_multiplier=1.7, attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5,
)


def make_tiny_granite_swa(path: Path, *, seed: int = 0, with_tokenizer: bool = False, **overrides: Any) -> Path:
    """Granite SWA: full attention on layer 0 and a window of 5 tokens on the others, a NoPE layer,
    two RoPE bases, random (non-zero) sinks and non-unit multipliers; tied embeddings."""
    from transformers import GraniteSWAConfig

    options = {**_COMMON, **_GRANITE_SWA, "rope_parameters": _rope(None, 10000.0), "tie_word_embeddings": True,
               "architectures": ["GraniteSWAForCausalLM"], **overrides}
    return _save_random(GraniteSWAConfig(**options), path, seed, with_tokenizer)


def make_tiny_granitemoe_swa(path: Path, *, seed: int = 0, with_tokenizer: bool = False,
                             **overrides: Any) -> Path:
    """GraniteMoe SWA: the layers of make_tiny_granite_swa with 4 experts, top-2, and a shared MLP
    (as wide as an expert unless ``shared_intermediate_size`` says otherwise); untied."""
    from transformers import GraniteMoeSWAConfig

    options = {**_COMMON, **_GRANITE_SWA, "rope_parameters": _rope(None, 10000.0), "intermediate_size": 32,
               "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32,
               "tie_word_embeddings": False, "architectures": ["GraniteMoeSWAForCausalLM"], **overrides}
    return _save_random(GraniteMoeSWAConfig(**options), path, seed, with_tokenizer)


# DeepSeek-V3 MLA + MoE at test size: q LoRA, a dense first layer, 8 experts in 4 groups (2 kept),
# top-2, one shared expert, YaRN with an mscale_all_dim that changes the softmax scale and an
# mscale that makes the cos/sin attention factor != 1; v_head_dim differs from qk_nope_head_dim.
_DEEPSEEK = dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
    q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    moe_intermediate_size=32, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                     "rope_theta": 10000.0},
    tie_word_embeddings=False,
)
# DSA at test size: index_topk far below the prompts, so queries attend to a few of their keys.
# 32 indexer heads: with 8, a key whose every head has a negative q.k (score exactly 0) was common
# enough that tied scores at the top-k boundary made the kept keys an implementation's choice.
_DSA = dict(index_n_heads=32, index_head_dim=16, index_topk=8)


# DeepSeek shapes the CUDA kernels take (triton_mla: kv_lora_rank, qk_rope_head_dim and
# index_head_dim powers of two >= 16; 8 heads fill half of its smallest head block, the rest
# masked); 16 experts in 4 groups (2 kept), top 4. The rest is ``_DEEPSEEK``: q LoRA, a dense
# first layer, one shared expert, a random correction bias, YaRN from 128 positions. No pad
# token: transformers zeroes its embedding row, and a generated pad token's zero indexer query
# scores every key 0, a tie whose top-k is any implementation's choice.
DEEPSEEK_TRITON_SHAPES = dict(
    hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=128, pad_token_id=None)


def make_tiny_deepseek_v3(path: Path, *, seed: int = 0, with_tokenizer: bool = False, **overrides: Any) -> Path:
    """DeepSeek-V3 (``_DEEPSEEK``), a random non-zero ``e_score_correction_bias``; ``q_lora_rank=None``
    gives the plain ``q_proj`` variant."""
    from transformers import DeepseekV3Config

    options = {**_COMMON, **_DEEPSEEK, "architectures": ["DeepseekV3ForCausalLM"], **overrides}
    return _save_random(DeepseekV3Config(**options), path, seed, with_tokenizer,
                        random_buffers=("e_score_correction_bias",))


def make_tiny_deepseek_v32(path: Path, *, seed: int = 0, with_tokenizer: bool = False, **overrides: Any) -> Path:
    """DeepSeek-V3.2: ``make_tiny_deepseek_v3``'s layers, every one sparse with an indexer of 32
    heads of 16 dims keeping ``index_topk=8`` keys per query."""
    from transformers import DeepseekV32Config

    options = {**_COMMON, **_DEEPSEEK, **_DSA, "architectures": ["DeepseekV32ForCausalLM"], **overrides}
    return _save_random(DeepseekV32Config(**options), path, seed, with_tokenizer,
                        random_buffers=("e_score_correction_bias",))


def make_tiny_glm_moe_dsa(path: Path, *, seed: int = 0, with_tokenizer: bool = False, **overrides: Any) -> Path:
    """GLM-MoE-DSA (GLM-5): the DeepSeek-V3.2 layers of ``make_tiny_deepseek_v32`` with interleaved
    indexer RoPE, every layer running its own indexer unless ``indexer_types`` names "shared" ones."""
    from transformers import GlmMoeDsaConfig

    options = {**_COMMON, **_DEEPSEEK, **_DSA, "architectures": ["GlmMoeDsaForCausalLM"], **overrides}
    return _save_random(GlmMoeDsaConfig(**options), path, seed, with_tokenizer,
                        random_buffers=("e_score_correction_bias",))


# Kimi Linear at test size: 5 layers declared as the released checkpoints declare them (1-indexed
# lists, the last layer MLA), KDA with 2 heads of 16 and a 4-tap conv, MLA without q LoRA (and
# v_head_dim != qk_nope_head_dim), layer 1 dense, 8 experts top-2 in one group plus a shared expert.
KIMI_LINEAR_ATTN_CONFIG = {"kda_layers": [1, 2, 4], "full_attn_layers": [3, 5], "num_heads": 2, "head_dim": 16,
                           "short_conv_kernel_size": 4}
_KIMI_LINEAR = dict(
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
    num_local_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
    moe_intermediate_size=32, routed_scaling_factor=2.446, norm_topk_prob=True, first_k_dense_replace=1,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)
# What transformers derives from the remote-code config and writes back: the released config.json
# has none of these (tests/test_kimi_linear.py reads both forms).
_KIMI_DERIVED_CONFIG_KEYS = ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                             "linear_conv_kernel_dim", "qk_head_dim", "head_dim")


def make_tiny_kimi_linear(path: Path, *, seed: int = 0, with_tokenizer: bool = False,
                          layout: str = "released", **overrides: Any) -> Path:
    """Kimi Linear (``_KIMI_LINEAR``, ``KIMI_LINEAR_ATTN_CONFIG``) with a random non-zero
    ``e_score_correction_bias`` and slow KDA decays (``A_log`` from log 0.02 to log 0.3, where
    transformers draws log 1 to log 16), so state carried across steps matters for many tokens.

    ``layout="released"`` rewrites transformers' save into the released checkpoints' form: the
    remote-code config (``linear_attn_config`` alone says the layer kinds; ``num_experts``,
    ``mla_use_nope``, ...) and the dense first layer under ``mlp.``. ``layout="transformers"``
    keeps what ``save_pretrained`` wrote (the dense layer under ``block_sparse_moe.``).
    """
    from safetensors.torch import load_file, save_file
    from transformers import KimiLinearConfig

    if layout not in ("released", "transformers"):
        raise ValueError(f"layout must be 'released' or 'transformers', got {layout!r}")
    options = {**_COMMON, **_KIMI_LINEAR, "linear_attn_config": KIMI_LINEAR_ATTN_CONFIG,
               "architectures": ["KimiLinearForCausalLM"], **overrides}
    config = KimiLinearConfig(**options)
    path = _save_random(config, path, seed, with_tokenizer, random_buffers=("e_score_correction_bias",))
    weights = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for name in weights:
        if name.endswith(".A_log"):
            decay_rate = torch.empty(weights[name].shape).uniform_(0.02, 0.3, generator=generator)
            weights[name] = decay_rate.log()
    if layout == "released":
        dense_layers = [i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"]
        for layer in dense_layers:
            prefix = f"model.layers.{layer}."
            for name in [n for n in weights if n.startswith(prefix + "block_sparse_moe.")]:
                weights[name.replace(".block_sparse_moe.", ".mlp.")] = weights.pop(name)
        config_file = path / "config.json"
        saved = json.loads(config_file.read_text())
        released = {key: value for key, value in saved.items() if key not in _KIMI_DERIVED_CONFIG_KEYS}
        released.update(mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1,
                        use_grouped_topk=True, num_nextn_predict_layers=0)
        config_file.write_text(json.dumps(released, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def tiny_model_config(path: Path, dtype: torch.dtype = torch.float32,
                      max_model_len: int | None = None) -> Any:
    """A ``weir.config.ModelConfig`` for a tiny checkpoint folder, built without EngineArgs."""
    from transformers import AutoConfig

    from weir.config import ModelConfig

    path = Path(path)
    hf_config = AutoConfig.from_pretrained(path)
    return ModelConfig(
        model=str(path), weights_path=path, tokenizer_path=path,
        architecture=hf_config.architectures[0], hf_config=hf_config, dtype=dtype,
        max_model_len=max_model_len or hf_config.max_position_embeddings,
        eos_token_ids=(TINY_EOS_ID,), served_model_name=path.name,
    )


def _byte_level_vocab() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, mapped to the byte's own value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    vocab = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in vocab.values():
            vocab[chr(256 + shifted)] = byte
            shifted += 1
    return vocab


def save_tiny_tokenizer(path: Path, vocab_size: int = TINY_VOCAB_SIZE) -> Path:
    """Byte-level BPE without merges: byte b is token id b (0-255), then <s>, </s>, <pad>.

    Any text round-trips; loadable with ``AutoTokenizer.from_pretrained(path)``; carries a
    small chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size <= TINY_PAD_ID:
        raise ValueError(f"vocab_size={vocab_size} must exceed {TINY_PAD_ID} (256 bytes + 3 specials)")
    tokenizer = Tokenizer(models.BPE(vocab=_byte_level_vocab(), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>", "<pad>"])
    assert tokenizer.token_to_id("</s>") == TINY_EOS_ID
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "model_max_length": 512, "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    return path


def add_made_up_mtp_weights(path: Path, *, seed: int = 0, source_layer: int = 1) -> Path:
    """Give a tiny Qwen3-Next checkpoint (``make_tiny_qwen3_next``) an ``mtp.*`` block in the layout
    of the released checkpoints: ``mtp.fc`` [hidden, 2 hidden], the pre-fc norms and the final norm,
    and one full-attention decoder layer (``mtp.layers.0``: a perturbed copy of full-attention layer
    ``source_layer``), in a shard of its own that the index lists beside the model's."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    hidden = next(t for n, t in tensors.items() if n == "model.embed_tokens.weight").shape[1]
    prefix = f"model.layers.{source_layer}."
    mtp = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            noise = torch.randn(tensor.shape, generator=gen) * 0.05 * (tensor.std() if tensor.numel() > 1 else 1)
            mtp["mtp.layers.0." + name[len(prefix):]] = (tensor + noise).contiguous()
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.1  # zero-centred: (1 + w)
    save_file(mtp, path / "mtp.safetensors")
    weight_map = {name: "model.safetensors" for name in tensors} | {name: "mtp.safetensors" for name in mtp}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def add_made_up_deepseek_mtp_weights(path: Path, *, seed: int = 0) -> Path:
    """Give a tiny DeepSeek-V3 or V3.2 checkpoint (``make_tiny_deepseek_v3`` / ``_v32``) one
    next-token module in the layout of the released checkpoints, at layer index
    ``num_hidden_layers``: a perturbed copy of the last (MoE) decoder layer (V3.2's with its indexer), ``enorm`` / ``hnorm`` / ``eh_proj`` [hidden, 2 hidden],
    ``shared_head.norm``, and copies of the embedding and the LM head (``embed_tokens``,
    ``shared_head.head``), in a second shard: the model's becomes the first, and an index lists
    both (transformers reads a lone ``model.safetensors`` in preference to an index)."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    source, target = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    mtp = {}
    for name, tensor in tensors.items():
        if name.startswith(source):
            noise = torch.randn(tensor.shape, generator=gen) * 0.05 * (tensor.std() if tensor.numel() > 1 else 1)
            mtp[target + name[len(source):]] = (tensor + noise).contiguous()
    mtp[target + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    for norm in ("enorm", "hnorm", "shared_head.norm"):  # far from 1: a norm applied twice shows
        mtp[f"{target}{norm}.weight"] = 0.2 + 2 * torch.rand(hidden, generator=gen)
    mtp[target + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[target + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    (path / "model.safetensors").rename(path / shards[0])
    save_file(mtp, path / shards[1])
    weight_map = {name: shards[0] for name in tensors} | {name: shards[1] for name in mtp}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_tiny_eagle(path: Path, target_path: Path, *, eagle3: bool = False, seed: int = 0,
                    draft_vocab_size: int = 200, aux_layers: list[int] | None = None) -> Path:
    """A random EAGLE (or EAGLE-3) head for the tiny Llama at ``target_path``, in the layout vLLM
    loads: EAGLE ``fc`` [H, 2H] and ``layers.0.*`` without an input norm (the target's embedding
    and LM head are shared); EAGLE-3 ``fc`` [H, 3H], ``midlayer.*`` (q/k/v from 2H),
    ``norm``, its own ``lm_head`` over ``draft_vocab_size`` ids and ``d2t`` / ``t2d`` maps."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(target_path)
    config.num_hidden_layers = 1
    config.architectures = ["Eagle3LlamaForCausalLM" if eagle3 else "EagleLlamaForCausalLM"]
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return (torch.randn(shape, generator=gen) * scale).contiguous()

    def norm():
        return 1.0 + rand(hidden)

    attn_in = 2 * hidden if eagle3 else hidden
    layer = {"self_attn.q_proj.weight": rand(heads * head_dim, attn_in), "self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
             "self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in), "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
             "mlp.gate_proj.weight": rand(config.intermediate_size, hidden), "mlp.up_proj.weight": rand(config.intermediate_size, hidden),
             "mlp.down_proj.weight": rand(hidden, config.intermediate_size), "post_attention_layernorm.weight": norm()}
    if eagle3:
        tensors = {f"midlayer.{name}": t for name, t in layer.items()}
        tensors |= {"midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
                    "fc.weight": rand(hidden, 3 * hidden), "norm.weight": norm(),
                    "lm_head.weight": rand(draft_vocab_size, hidden, scale=0.5)}
        targets = torch.randperm(config.vocab_size, generator=gen)[:draft_vocab_size].sort().values
        tensors["d2t"] = targets - torch.arange(draft_vocab_size)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
        config.draft_vocab_size = draft_vocab_size
        if aux_layers is not None:
            config.eagle_aux_hidden_state_layer_ids = aux_layers
    else:
        tensors = {f"layers.0.{name}": t for name, t in layer.items()}
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
    save_file(tensors, path / "model.safetensors")
    config.save_pretrained(path)
    return path
