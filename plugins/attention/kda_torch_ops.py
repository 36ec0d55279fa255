"""Kimi Delta Attention maths in plain torch: the delta rule with a decay per key channel.

These pure functions are the oracle faster backends are tested against (they are tested against
transformers' Kimi Linear fallbacks). Everything is computed in fp32; outputs are cast back to
the value dtype and recurrent states stay fp32, laid out ``[heads, K, V]`` (``o = q^T S``) as in
transformers and fla. The short conv is Gated DeltaNet's (``gdn_torch_ops.causal_conv1d_with_state``).
"""

from __future__ import annotations

import torch

from weir.plugins.attention.gdn_torch_ops import to_chunks

L2NORM_EPS = 1e-6
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, in fp32 (the formula of transformers' Kimi
    Linear and of fla's kernels; Qwen3-Next's multiplies by an rsqrt, which rounds differently)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, initial_state, normalize_qk):
    """fp32 inputs, L2-normalised q and k, q scaled by ``K ** -0.5``, and the fp32 initial state
    ``[batch, heads, K, V]`` (zeros when none is given)."""
    batch, _, num_heads, head_k_dim = k.shape
    if q.shape != k.shape or g.shape != k.shape or v.shape[:3] != k.shape[:3] or beta.shape != k.shape[:3]:
        raise ValueError(f"Kimi Delta Attention inputs disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}; expected q, k and g "
                         f"[batch, seq_len, heads, K], v [batch, seq_len, heads, V], beta [batch, seq_len, heads]")
    q, k = q.float(), k.float()
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * head_k_dim**-0.5
    if initial_state is None:
        state = torch.zeros(batch, num_heads, head_k_dim, v.shape[-1], dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float()  # [batch, heads, K, V]
    return q, k, v.float(), g.float(), beta.float(), state


def recurrent_kda(
    q: torch.Tensor,  # [batch, seq_len, heads, K]
    k: torch.Tensor,  # [batch, seq_len, heads, K]
    v: torch.Tensor,  # [batch, seq_len, heads, V]
    g: torch.Tensor,  # [batch, seq_len, heads, K] log-decay per key channel (<= 0)
    beta: torch.Tensor,  # [batch, seq_len, heads]
    initial_state: torch.Tensor | None = None,  # [batch, heads, K, V]
    normalize_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule one token at a time (best for decode).

    Per token: ``S = diag(e^g) S; S += k (beta (v - S^T k))^T; o = S^T q``, with q scaled by
    ``K ** -0.5`` (after L2-normalising q and k when ``normalize_qk``). Returns the output
    ``[batch, seq_len, heads, V]`` in ``v``'s dtype and the final fp32 state.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, normalize_qk)
    outputs = []
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[..., None]  # each key row of S decays by its own channel
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])  # [batch, heads, V]
        correction = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * correction[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return out.to(out_dtype), state


def chunk_kda(
    q: torch.Tensor,  # [batch, seq_len, heads, K]
    k: torch.Tensor,  # [batch, seq_len, heads, K]
    v: torch.Tensor,  # [batch, seq_len, heads, V]
    g: torch.Tensor,  # [batch, seq_len, heads, K] log-decay per key channel (<= 0)
    beta: torch.Tensor,  # [batch, seq_len, heads]
    initial_state: torch.Tensor | None = None,  # [batch, heads, K, V]
    normalize_qk: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule as :func:`recurrent_kda`, a chunk of tokens at a time.

    Inside a chunk with cumulative log-decay ``c_t [K]`` and chunk-start state ``S0``, the state
    corrections ``u`` solve the unit lower-triangular system
    ``u_t + sum_{s<t} beta_t (k_t . (e^{c_t - c_s} * k_s)) u_s = beta_t (v_t - (e^{c_t} * k_t)^T S0)``,
    after which outputs and the next chunk's state are matmuls. Unlike Gated DeltaNet's, the decay
    between two tokens differs per channel, so it cannot factor out of ``k_t . k_s``: the pairwise
    decays ``[chunk, chunk, K]`` are built one chunk at a time to bound memory.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, normalize_qk)
    batch, seq_len, num_heads, head_k_dim = k.shape
    head_v_dim = v.shape[-1]
    num_chunks = -(-seq_len // chunk_size)  # the last one zero-padded (to_chunks)

    # [batch, heads, num_chunks, chunk_size, dim]
    q, k, v = to_chunks(q, chunk_size), to_chunks(k, chunk_size), to_chunks(v, chunk_size)
    beta = to_chunks(beta, chunk_size)  # [batch, heads, num_chunks, chunk_size]
    cum_decay = to_chunks(g, chunk_size).cumsum(dim=3)  # [batch, heads, num_chunks, chunk_size, K]

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    identity = torch.eye(chunk_size, device=v.device)
    out = v.new_empty(batch, num_heads, num_chunks, chunk_size, head_v_dim)
    for c in range(num_chunks):
        q_c, k_c, v_c, beta_c, cum_c = q[:, :, c], k[:, :, c], v[:, :, c], beta[:, :, c], cum_decay[:, :, c]
        # e^{c_t - c_s} per channel for s <= t; masked before exp, where s > t could overflow.
        log_pairwise = cum_c[:, :, :, None, :] - cum_c[:, :, None, :, :]  # [batch, heads, t, s, K]
        pairwise_decay = log_pairwise.masked_fill(~causal[:, :, None], float("-inf")).exp()
        decayed_k = pairwise_decay * k_c[:, :, None, :, :]  # e^{c_t - c_s} * k_s at [t, s]
        key_similarity = torch.einsum("bhtk,bhtsk->bhts", k_c, decayed_k)  # [batch, heads, t, s]
        query_key = torch.einsum("bhtk,bhtsk->bhts", q_c, decayed_k)  # includes s = t (decay 1)

        system = identity + (beta_c[..., None] * key_similarity).tril(-1)
        values_part = torch.linalg.solve_triangular(system, beta_c[..., None] * v_c, upper=False,
                                                    unitriangular=True)  # [batch, heads, chunk_size, V]
        decayed_keys = beta_c[..., None] * cum_c.exp() * k_c  # [batch, heads, chunk_size, K]
        state_part = torch.linalg.solve_triangular(system, decayed_keys, upper=False, unitriangular=True)
        corrections = values_part - state_part @ state  # u, [batch, heads, chunk_size, V]

        out[:, :, c] = (q_c * cum_c.exp()) @ state + query_key @ corrections
        chunk_total = cum_c[:, :, -1]  # [batch, heads, K]
        keys_to_end = k_c * (chunk_total[:, :, None] - cum_c).exp()  # decay from each token to chunk end
        state = state * chunk_total.exp()[..., None] + keys_to_end.transpose(-1, -2) @ corrections

    out = out.reshape(batch, num_heads, -1, head_v_dim)[:, :, :seq_len].transpose(1, 2)
    return out.to(out_dtype), state  # [batch, seq_len, heads, V], fp32 state
