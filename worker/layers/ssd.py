"""The Mamba-2 state-space scan: the chunked (parallel) form for prefill and the recurrent step for decode.

Mamba-2's SSM layer (Dao & Gu 2024, "Transformers are SSMs", arXiv:2405.21060; the "state space
duality", SSD) keeps per head ``h`` a state ``S_h (head_dim, d_state)`` and, for each input row ``t``:

    a_t = exp(dt_t * A_h)                          A_h = -exp(A_log_h) < 0, so 0 < a_t < 1
    S_t = a_t * S_{t-1} + dt_t * x_t B_t^T         x_t (head_dim,), B_t (d_state,)
    y_t = S_t C_t + D_h * x_t                      C_t (d_state,)

``B`` and ``C`` come in ``n_groups`` groups shared by consecutive heads (head ``h`` reads group
``h // (num_heads / n_groups)``), as grouped-query attention shares keys.

:func:`ssd_recurrent_step` is that recurrence, one row for each of a batch of sequences.
:func:`ssd_chunked_scan` computes the same outputs for a run of rows of one sequence a chunk at a
time (SSD's block decomposition, paper section 6): inside a chunk of ``Q`` rows, with
``c_t = sum_{u<=t} dt_u A`` the cumulative log-decay,

    y_t = sum_{s<=t} (C_t . B_s) exp(c_t - c_s) dt_s x_s      the "diagonal block": a masked attention
        + exp(c_t) C_t S_prev                                 the state carried in from earlier chunks
        + D x_t
    S_next = exp(c_Q) S_prev + sum_s exp(c_Q - c_s) dt_s x_s B_s^T

Reference implementation: ``transformers``' ``modeling_mamba2.py`` (``torch_forward``, the
chunked form, and the single-token ``cache_params`` path); our code is written from the maths above.
Everything is computed in float32 (the state is float32 whatever the activations); outputs are
float32, the caller casts. The two forms agree to float rounding (tests/worker/test_mamba2_layer.py).
"""

from __future__ import annotations

import torch


def expand_groups(bc: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(..., n_groups, d_state)`` -> ``(..., num_heads, d_state)``: each group repeated for its heads."""
    groups = bc.shape[-2]
    return bc.repeat_interleave(num_heads // groups, dim=-2)


def ssd_chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows through the scan, chunk by chunk, from ``state``.

    Args:
        x: ``(L, H, P)`` the inputs (after the convolution), any float dtype.
        dt: ``(L, H)`` the time steps, already ``softplus(dt + dt_bias)`` and clamped.
        A: ``(H,)`` float32, ``-exp(A_log)``.
        B, C: ``(L, G, N)`` with ``H % G == 0``.
        D: ``(H,)`` the skip weights.
        state: ``(H, P, N)`` float32, the state before the first row (zeros for a new sequence).
        chunk_size: ``Q``, rows per chunk (the checkpoint's ``chunk_size``; any value gives the same
            maths, it bounds the ``(Q, Q)`` decay matrix).

    Returns:
        ``(y (L, H, P) float32, final state (H, P, N) float32)``; ``state`` is not modified.
    """
    num_rows, num_heads, _ = x.shape
    x32, dt32 = x.float(), dt.float()
    B32, C32 = expand_groups(B.float(), num_heads), expand_groups(C.float(), num_heads)  # (L, H, N) each
    s = state.float()
    outputs = []
    for start in range(0, num_rows, chunk_size):
        end = min(start + chunk_size, num_rows)
        xc, dtc, Bc, Cc = x32[start:end], dt32[start:end], B32[start:end], C32[start:end]
        log_decay = torch.cumsum(dtc * A, dim=0)  # (Q, H): c_t
        # exp(c_t - c_s) for s <= t, else 0; the masked entries never reach exp (no inf * 0).
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=x.device).tril()  # (Q, Q)
        gap = log_decay[:, None, :] - log_decay[None, :, :]  # (Q_t, Q_s, H)
        decay = torch.where(causal[:, :, None], gap, torch.full_like(gap, float("-inf"))).exp()  # (Q, Q, H)
        scores = torch.einsum("thn,shn->tsh", Cc, Bc) * decay  # (Q, Q, H): (C_t . B_s) exp(c_t - c_s)
        xdt = xc * dtc[:, :, None]  # (Q, H, P): dt_s x_s
        y = torch.einsum("tsh,shp->thp", scores, xdt)  # (Q, H, P) within the chunk
        y = y + torch.einsum("thn,hpn->thp", Cc, s) * log_decay.exp()[:, :, None]  # + exp(c_t) C_t S_prev
        to_end = (log_decay[-1:] - log_decay).exp()  # (Q, H): exp(c_Q - c_s)
        s = s * log_decay[-1].exp()[:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, xdt, Bc)  # (H, P, N)
        outputs.append(y)
    y = torch.cat(outputs) if outputs else x32.new_zeros(x32.shape)
    return y + x32 * D.float()[None, :, None], s  # (L, H, P), (H, P, N)


def ssd_recurrent_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One new row for each of ``S`` sequences, their states read from and written back to a pool.

    Args:
        x: ``(S, H, P)``; dt: ``(S, H)`` (after softplus and clamp); A, D: ``(H,)``;
        B, C: ``(S, G, N)``.
        states: ``(num_slots, H, P, N)`` float32, the layer's state pool; updated in place.
        slots: ``(S,) int64`` each sequence's slot.

    Returns:
        ``(S, H, P)`` float32: ``y = S_t C_t + D x`` with ``S_t = exp(dt A) S_{t-1} + dt x B^T``.
    """
    num_heads = x.shape[1]
    x32, dt32 = x.float(), dt.float()
    B32, C32 = expand_groups(B.float(), num_heads), expand_groups(C.float(), num_heads)  # (S, H, N)
    s = states.index_select(0, slots)  # (S, H, P, N)
    decay = (dt32 * A).exp()  # (S, H)
    s = s * decay[:, :, None, None] + (x32 * dt32[:, :, None])[:, :, :, None] * B32[:, :, None, :]
    states.index_copy_(0, slots, s.to(states.dtype))
    y = torch.einsum("shpn,shn->shp", s, C32)  # (S, H, P)
    return y + x32 * D.float()[None, :, None]
