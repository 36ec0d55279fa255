"""EAGLE and EAGLE-3 draft heads for Llama-skeleton targets, from checkpoints in the layout vLLM
loads (``llama_eagle.py``, ``llama_eagle3.py``). A leading ``model.`` on names is accepted.

EAGLE (``method: eagle``): ``fc [H, 2H]`` (bias optional) over ``[embed(token), hidden]``, then
``layers.N`` Llama decoder layers (layer 0 usually without ``input_layernorm``: EAGLE feeds it
the projection as it is), then ``norm`` if the checkpoint has one; the output is both the LM
head's input and the next pass's hidden state, the target's post-norm features being what it
predicts. The embedding and the LM head are the target's unless the checkpoint has its own.

EAGLE-3 (``method: eagle3``): the first pass's hidden state is three of the target's residual
streams (the inputs of layers ``eagle_aux_hidden_state_layer_ids``, by default 2, L/2 and L-3 as
vLLM takes them) concatenated, projected by ``fc [H, 3H]``; ``midlayer`` attends over
``[input_layernorm(embed(token)), hidden_norm(hidden)]`` (q/k/v from 2H) with the projected
hidden as its residual; ``norm`` gives the LM head's input, the pre-norm sum the next hidden. Its
LM head covers a smaller draft vocabulary: draft id ``i`` is target id ``i + d2t[i]``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from weir.layers import (QKV_GATE_UP_STACKED_PARAMS, GatedMLP, LMHead, Linear, QKVLinear, RMSNorm, RopeSelfAttention,
                         RotaryEmbedding, VocabEmbedding, head_dim_of, num_kv_heads_of)
from weir.spec_decode.draft_head import TargetSharedHead


class _PassThroughNorm(nn.Module):
    """Stands in for an input norm an EAGLE layer does not have (``x``, or the residual sum)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        total = x + residual
        return total, total


class _LlamaLayer(nn.Module):
    """A Llama decoder layer (pre-norm attention and gated MLP), named as the checkpoints name it."""

    def __init__(self, hf_config: Any, layer_idx: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden = hf_config.hidden_size
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.self_attn = RopeSelfAttention(hidden, hf_config.num_attention_heads, num_kv_heads_of(hf_config),
                                           head_dim_of(hf_config), layer_idx, rotary_emb, qkv_bias=bias, o_bias=bias)
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act)
        self.input_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, ctx):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def checkpoint_names(model_config) -> set[str]:
    from safetensors import safe_open

    from weir.weights.safetensors_files import safetensors_files

    names = set()
    for path in safetensors_files(model_config.weights_path):
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            names.update(reader.keys())
    return {name.removeprefix("model.") for name in names}


class _HeadBase(TargetSharedHead):
    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    ignored_checkpoint_patterns = (r"rotary_emb\.inv_freq$", r"(^|\.)t2d$")

    def embedding(self) -> nn.Module:
        return self.embed_tokens if self.embed_tokens is not None else super().embedding()

    def output_head(self) -> nn.Module:
        return self.lm_head if self.lm_head is not None else super().output_head()


class EagleLlamaHead(_HeadBase):
    def __init__(self, config):
        super().__init__()
        hf_config = config.hf_config
        flags = hf_config.weir_eagle
        hidden = hf_config.hidden_size
        self.rotary_emb = RotaryEmbedding(hf_config, head_dim_of(hf_config), config.max_model_len)
        self.fc = Linear(2 * hidden, hidden, bias=flags["fc_bias"])
        self.layers = nn.ModuleList(_LlamaLayer(hf_config, i, self.rotary_emb) for i in range(flags["num_layers"]))
        if not flags["first_input_norm"]:
            self.layers[0].input_layernorm = _PassThroughNorm()
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps) if flags["norm"] else None
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hidden) if flags["embed"] else None
        self.lm_head = LMHead(hidden, hf_config.vocab_size) if flags["lm_head"] else None

    def forward(self, input_ids, positions, hidden, ctx, step: int):
        embeds = self.embedding()(input_ids)  # [num_tokens, hidden]
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        out = self.norm(x, residual)[0] if self.norm is not None else x + residual
        return out, out

    def attention_layers(self):
        return [layer.self_attn.attn.spec for layer in self.layers]


class _Eagle3Layer(nn.Module):
    """``midlayer``: attention over the normed embedding and hidden state side by side."""

    def __init__(self, hf_config: Any, rotary_emb: RotaryEmbedding):
        super().__init__()
        hidden = hf_config.hidden_size
        heads, kv_heads, head_dim = hf_config.num_attention_heads, num_kv_heads_of(hf_config), head_dim_of(hf_config)
        self.self_attn = RopeSelfAttention(hidden, heads, kv_heads, head_dim, 0, rotary_emb)
        self.self_attn.qkv_proj = QKVLinear(2 * hidden, heads, kv_heads, head_dim)
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act)
        self.input_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, hf_config.rms_norm_eps)


class Eagle3LlamaHead(_HeadBase):
    def __init__(self, config):
        super().__init__()
        hf_config = config.hf_config
        flags = hf_config.weir_eagle
        hidden = hf_config.hidden_size
        draft_vocab = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
        self.rotary_emb = RotaryEmbedding(hf_config, head_dim_of(hf_config), config.max_model_len)
        self.fc = Linear(3 * hidden, hidden, bias=flags["fc_bias"])
        self.midlayer = _Eagle3Layer(hf_config, self.rotary_emb)
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hidden) if flags["embed"] else None
        self.lm_head = LMHead(hidden, draft_vocab)
        self.vocab_size = hf_config.vocab_size
        # Offsets to the target's ids; a parameter so the loader fills it (integers stay integers).
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.int64), requires_grad=False) \
            if flags["d2t"] else None
        self.aux_layer_ids = tuple(flags["aux_layers"] or ())  # empty: vLLM's default, once the target is known
        self._aux: dict[int, torch.Tensor] = {}

    def process_weights_after_loading(self) -> None:
        if self.d2t is None:
            return
        # A broken map would send drafts outside the target's vocabulary: a device assert in the
        # embedding steps later. Checked once, at load.
        targets = torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t  # [draft_vocab]
        bad = ((targets < 0) | (targets >= self.vocab_size)).nonzero()
        if bad.numel():
            index = int(bad[0, 0])
            raise ValueError(f"eagle3 checkpoint: d2t[{index}] = {int(self.d2t[index])} maps draft id {index} to "
                             f"{int(targets[index])}, outside the target's vocabulary [0, {self.vocab_size})")

    def watch_target(self, target: nn.Module) -> None:
        layers = getattr(getattr(target, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"eagle3 needs the target's decoder layers as model.layers; {type(target).__name__} "
                             f"has none")
        if not self.aux_layer_ids:  # vLLM's default: 2, L // 2, L - 3
            self.aux_layer_ids = (2, len(layers) // 2, len(layers) - 3)
        bad = [i for i in self.aux_layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"eagle3: eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)} name layers "
                             f"{bad}, but the target has {len(layers)}")
        for layer_id in set(self.aux_layer_ids):
            layers[layer_id].register_forward_pre_hook(self._hook(layer_id))

    def _hook(self, layer_id: int):
        def keep_residual_stream(module, args):
            # (positions, hidden_states, residual, ctx): the layer's input is their sum.
            hidden, residual = args[1], args[2]
            self._aux[layer_id] = hidden if residual is None else hidden + residual
        return keep_residual_stream

    def target_hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._aux[i] for i in self.aux_layer_ids], dim=-1)  # [num_tokens, 3H]

    def forward(self, input_ids, positions, hidden, ctx, step: int):
        layer = self.midlayer
        if hidden.shape[-1] != self.norm.weight.shape[0]:
            hidden = self.fc(hidden)  # the target's three streams, first pass
        residual = hidden
        embeds = layer.input_layernorm(self.embedding()(input_ids))
        x = layer.self_attn(positions, torch.cat([embeds, layer.hidden_norm(hidden)], dim=-1), ctx)
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self.lm_head(hidden).argmax(dim=-1)
        return ids if self.d2t is None else ids + self.d2t[ids]

    def attention_layers(self):
        return [self.midlayer.self_attn.attn.spec]


_LAYER = re.compile(r"^layers\.(\d+)\.")


def eagle_head_class(method: str, model_config):
    """The head class for ``method`` and ``model_config`` carrying what its checkpoint holds."""
    from weir.spec_decode.eagle import with_hf_config

    names = checkpoint_names(model_config)
    hf_config = model_config.hf_config
    common = {"fc_bias": "fc.bias" in names, "embed": "embed_tokens.weight" in names}
    if method == "eagle":
        if "fc.weight" not in names or not any(_LAYER.match(n) for n in names):
            raise ValueError(f"{model_config.model} is not an EAGLE checkpoint: it has no fc.weight and layers.N.* "
                             f"tensors (the layout vLLM loads)")
        num_layers = 1 + max(int(_LAYER.match(n).group(1)) for n in names if _LAYER.match(n))
        flags = {**common, "num_layers": num_layers, "first_input_norm": "layers.0.input_layernorm.weight" in names,
                 "norm": "norm.weight" in names, "lm_head": "lm_head.weight" in names}
        head_cls = EagleLlamaHead
    else:
        if "midlayer.self_attn.q_proj.weight" not in names:
            raise ValueError(f"{model_config.model} is not an EAGLE-3 checkpoint: it has no midlayer.* tensors "
                             f"(the layout vLLM loads)")
        aux = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
        eagle_config = getattr(hf_config, "eagle_config", None)
        if aux is None and isinstance(eagle_config, dict):
            aux = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        flags = {**common, "d2t": "d2t" in names, "aux_layers": aux}
        head_cls = Eagle3LlamaHead
    return head_cls, with_hf_config(model_config, weir_eagle=flags)
