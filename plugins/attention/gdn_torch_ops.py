"""Gated DeltaNet maths in plain torch: the short causal conv and the gated delta rule.

These pure functions are the oracle that faster backends are tested against (they are tested
against transformers' Qwen3-Next layer). Everything is computed in fp32; outputs are cast back to
the input dtype and recurrent states stay fp32. Recurrent states are laid out ``[heads, Dk, Dv]``
(``o = q^T S``), as in transformers and fla.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
CHUNK_SIZE = 64


def causal_conv1d_with_state(
    x: torch.Tensor,  # [batch, seq_len, channels]
    conv_state: torch.Tensor,  # [batch, channels, kernel]: the last `kernel` inputs, oldest first
    weight: torch.Tensor,  # [channels, kernel]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU continuing from ``conv_state``.

    The output for token t uses the ``kernel`` inputs ending at t, reaching back into the state
    for the first tokens (a zero state is the usual left zero padding). Returns the output
    ``[batch, seq_len, channels]`` in ``x``'s dtype and the new state (the last ``kernel``
    inputs, in ``conv_state``'s dtype). The inputs are left untouched.
    """
    batch, seq_len, channels = x.shape
    kernel = weight.shape[-1]
    if conv_state.shape != (batch, channels, kernel):
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected {(batch, channels, kernel)}")
    window = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [batch, channels, kernel + seq_len]
    # A valid conv over kernel + seq_len inputs gives seq_len + 1 outputs; the first one belongs to
    # the last token of the previous step.
    conv_out = F.conv1d(window.float(), weight.float().unsqueeze(1), groups=channels)[..., 1:]
    out = F.silu(conv_out).transpose(1, 2).to(x.dtype)  # [batch, seq_len, channels]
    new_state = window[..., -kernel:].to(conv_state.dtype)  # [batch, channels, kernel]
    return out, new_state


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim, in fp32 (the Qwen3-Next/fla formula)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, initial_state, normalize_qk):
    """Shared input handling: GVA expansion, fp32, L2-norm, q scaling, initial state.

    Returns q and k ``[batch, seq_len, num_v_heads, head_k_dim]``, v, g and beta in fp32, and the
    fp32 state ``[batch, num_v_heads, head_k_dim, head_v_dim]`` (zeros when none is given).
    """
    batch, _, num_k_heads, head_k_dim = k.shape
    num_v_heads, head_v_dim = v.shape[-2:]
    if num_v_heads % num_k_heads != 0:
        raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of num_k_heads={num_k_heads}")
    # Value head h reads q/k head h // group.
    group = num_v_heads // num_k_heads
    q = q.float().repeat_interleave(group, dim=2)  # [batch, seq_len, num_v_heads, head_k_dim]
    k = k.float().repeat_interleave(group, dim=2)
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * head_k_dim**-0.5
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float()  # [batch, num_v_heads, head_k_dim, head_v_dim]
    return q, k, v.float(), g.float(), beta.float(), state


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[batch, seq_len, heads, ...]`` -> ``[batch, heads, num_chunks, chunk_size, ...]``, the last
    chunk zero-padded (zero k, beta and g leave a delta rule's state unchanged)."""
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, -x.shape[1] % chunk_size))
    x = x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])
    return x.movedim(3, 1)


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [batch, seq_len, num_k_heads, head_k_dim]
    k: torch.Tensor,  # [batch, seq_len, num_k_heads, head_k_dim]
    v: torch.Tensor,  # [batch, seq_len, num_v_heads, head_v_dim]
    g: torch.Tensor,  # [batch, seq_len, num_v_heads] log-decay (<= 0)
    beta: torch.Tensor,  # [batch, seq_len, num_v_heads]
    initial_state: torch.Tensor | None = None,  # [batch, num_v_heads, head_k_dim, head_v_dim]
    normalize_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (best for decode).

    Per token: ``S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q``, with q scaled by
    ``head_k_dim ** -0.5`` (after L2-normalising q and k when ``normalize_qk``). Returns the
    output ``[batch, seq_len, num_v_heads, head_v_dim]`` in ``v``'s dtype and the final fp32 state.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, normalize_qk)
    outputs = []
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])  # [batch, num_v_heads, head_v_dim]
        correction = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * correction[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return out.to(out_dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [batch, seq_len, num_k_heads, head_k_dim]
    k: torch.Tensor,  # [batch, seq_len, num_k_heads, head_k_dim]
    v: torch.Tensor,  # [batch, seq_len, num_v_heads, head_v_dim]
    g: torch.Tensor,  # [batch, seq_len, num_v_heads] log-decay (<= 0)
    beta: torch.Tensor,  # [batch, seq_len, num_v_heads]
    initial_state: torch.Tensor | None = None,  # [batch, num_v_heads, head_k_dim, head_v_dim]
    normalize_qk: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule as :func:`recurrent_gated_delta_rule`, a chunk of tokens at a time.

    Inside a chunk with cumulative log-decay ``c_t`` and chunk-start state ``S0``, the state
    corrections ``u`` solve the unit lower-triangular system
    ``u_t + sum_{s<t} beta_t e^{c_t - c_s} (k_t.k_s) u_s = beta_t (v_t - e^{c_t} S0^T k_t)``
    (the WY/UT form), after which outputs and the next chunk's state are plain matmuls.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, normalize_qk)
    batch, seq_len, num_heads, head_k_dim = k.shape
    head_v_dim = v.shape[-1]
    num_chunks = -(-seq_len // chunk_size)  # the last one zero-padded (to_chunks)

    # [batch, heads, num_chunks, chunk_size, dim]
    q, k, v = to_chunks(q, chunk_size), to_chunks(k, chunk_size), to_chunks(v, chunk_size)
    beta = to_chunks(beta, chunk_size)  # [batch, heads, num_chunks, chunk_size]
    cum_decay = to_chunks(g, chunk_size).cumsum(dim=-1)  # [batch, heads, num_chunks, chunk_size]

    # e^{c_t - c_s} for s <= t; the upper triangle is masked before exp, where it could overflow.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    log_pairwise = cum_decay[..., :, None] - cum_decay[..., None, :]  # [..., chunk_size, chunk_size]
    pairwise_decay = log_pairwise.masked_fill(~causal, float("-inf")).exp()

    key_similarity = k @ k.transpose(-1, -2)  # [batch, heads, num_chunks, chunk_size, chunk_size]
    system = torch.eye(chunk_size, device=v.device) + (beta[..., None] * key_similarity * pairwise_decay).tril(-1)
    values_part = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    decayed_keys = beta[..., None] * cum_decay.exp()[..., None] * k  # [..., chunk_size, head_k_dim]
    state_part = torch.linalg.solve_triangular(system, decayed_keys, upper=False, unitriangular=True)
    # u = values_part - state_part @ S0, per chunk.

    intra_attn = (q @ k.transpose(-1, -2)) * pairwise_decay  # [..., chunk_size, chunk_size]
    decayed_q = q * cum_decay.exp()[..., None]  # reads S0 decayed up to each token
    chunk_total = cum_decay[..., -1:]  # [batch, heads, num_chunks, 1]
    keys_to_end = k * (chunk_total - cum_decay).exp()[..., None]  # decay from each token to chunk end

    out = v.new_empty(batch, num_heads, num_chunks, chunk_size, head_v_dim)
    for c in range(num_chunks):
        corrections = values_part[:, :, c] - state_part[:, :, c] @ state  # [batch, heads, chunk_size, head_v_dim]
        out[:, :, c] = decayed_q[:, :, c] @ state + intra_attn[:, :, c] @ corrections
        state = state * chunk_total[:, :, c, :, None].exp() + keys_to_end[:, :, c].transpose(-1, -2) @ corrections

    out = out.reshape(batch, num_heads, -1, head_v_dim)[:, :, :seq_len].transpose(1, 2)
    return out.to(out_dtype), state  # [batch, seq_len, num_v_heads, head_v_dim], fp32 state
