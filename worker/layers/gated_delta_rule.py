"""The gated delta rule: linear attention whose per-head state is decayed, then corrected towards each new value.

Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", arXiv:2412.06464, eq. 10; the reference forms are ``transformers``' ``torch_recurrent_gated_delta_rule``
and ``torch_chunk_gated_delta_rule`` in modeling_qwen3_next.py). Per value head, with a state
``S (d_k, d_v)`` and, at step ``t``, a unit-norm key ``k_t``, a query ``q_t`` (scaled by ``d_k ** -0.5``),
a value ``v_t``, a log-decay ``g_t <= 0`` and a write strength ``beta_t`` in (0, 1):

    S_t = exp(g_t) * S_{t-1}                                   decay (the gate, alpha_t = exp(g_t))
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T             delta rule: write the part of v_t S_t misses
    o_t = S_t^T q_t                                            read

:func:`recurrent_step` is that, one step for a batch of sequences (the decode group).
:func:`chunked` computes the same outputs and final state for one sequence ``C`` rows at a time
(the parallel form, for prefill): inside a chunk that starts from ``S_0``, with ``G_i = g_1 + ... + g_i``,

    S_i = exp(G_i) S_0 + sum_{j <= i} exp(G_i - G_j) k_j u_j^T
    u_i = beta_i (v_i - exp(G_i) S_0^T k_i - sum_{j < i} exp(G_i - G_j) (k_i . k_j) u_j)

so ``(I + A) U = beta * (V - exp(G) K S_0)`` with ``A`` strictly lower triangular,
``A_ij = beta_i exp(G_i - G_j) (k_i . k_j)``: one unit-triangular solve per chunk gives every ``u_i``
(the WY / UT form of DeltaNet), then

    o_i = exp(G_i) S_0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T.

Everything is float32 (the state is float32 in the pool whatever the activations).
"""

from __future__ import annotations

import torch

#: Rows per chunk of the parallel form (the chunk of flash-linear-attention's kernels and of the reference).
CHUNK_SIZE = 64


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule for ``B`` sequences at once.

    Args:
        q: ``(B, H, d_k)`` float32 queries, already L2-normalised and scaled by ``d_k ** -0.5``.
        k: ``(B, H, d_k)`` float32 keys, L2-normalised.
        v: ``(B, H, d_v)`` float32 values.
        g: ``(B, H)`` float32 log-decays (``<= 0``).
        beta: ``(B, H)`` float32 write strengths.
        state: ``(B, H, d_k, d_v)`` float32, the states before the step (not modified).

    Returns:
        ``o (B, H, d_v)`` float32 and the new state ``(B, H, d_k, d_v)`` float32.
    """
    s = state * g.exp()[..., None, None]  # (B, H, d_k, d_v) decayed
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)  # (B, H, d_v) what the state recalls for k
    u = beta[..., None] * (v - predicted)  # (B, H, d_v) the correction written
    s = s + k[..., :, None] * u[..., None, :]  # (B, H, d_k, d_v)
    o = torch.einsum("bhk,bhkv->bhv", q, s)  # (B, H, d_v)
    return o, s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``L`` rows of one sequence, ``chunk_size`` rows at a time (see the module docstring).

    Args:
        q, k: ``(L, H, d_k)`` float32, as :func:`recurrent_step`'s.
        v: ``(L, H, d_v)`` float32.
        g, beta: ``(L, H)`` float32.
        state: ``(H, d_k, d_v)`` float32, the state before the first row (not modified).
        chunk_size: rows per chunk (the last chunk may be shorter).

    Returns:
        ``o (L, H, d_v)`` float32, equal to :func:`recurrent_step` row after row up to float rounding, and the
        state after the last row ``(H, d_k, d_v)`` float32.
    """
    outputs = []
    for start in range(0, q.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        o, state = _chunk(q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                          g[rows].t(), beta[rows].t(), state)
        outputs.append(o.transpose(0, 1))  # (C, H, d_v)
    return torch.cat(outputs), state


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, heads first: ``q, k (H, C, d_k)``, ``v (H, C, d_v)``, ``g, beta (H, C)``, ``s0 (H, d_k, d_v)``."""
    c = q.shape[1]
    cum = g.cumsum(-1)  # (H, C) G_i
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= i
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: G_i - G_j > 0 there).
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # (H, C, C)
    a = (k @ k.transpose(1, 2)) * decay * beta[:, :, None]  # (H, C, C) beta_i exp(G_i - G_j) k_i.k_j
    # solve_triangular reads the strictly lower triangle only (unitriangular: the diagonal is taken as 1): I + A.
    rhs = beta[:, :, None] * (v - cum.exp()[:, :, None] * (k @ s0))  # (H, C, d_v)
    u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # (H, C, d_v)
    scores = (q @ k.transpose(1, 2)) * decay  # (H, C, C) exp(G_i - G_j) q_i.k_j, j <= i
    o = cum.exp()[:, :, None] * (q @ s0) + scores @ u  # (H, C, d_v)
    tail = (cum[:, -1:] - cum).exp()  # (H, C) exp(G_C - G_j)
    s = cum[:, -1, None, None].exp() * s0 + (k * tail[:, :, None]).transpose(1, 2) @ u  # (H, d_k, d_v)
    return o, s
