"""Causal depthwise 1-D convolution with a carried window: the short convolution of hybrid layers.

Gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba-2 (Granite 4, Nemotron-H) and LFM2's short
convolution all run a depthwise causal convolution of kernel ``K`` (typically 3-4) over their
channels. Across chunks and decode steps the last ``K - 1`` inputs are the state (the "conv state"
of Mamba's reference implementation, mamba_ssm / causal-conv1d); a fresh sequence starts from zeros,
which is what the reference's left zero-padding gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_state: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """One sequence's rows through the convolution, continuing from and updating ``conv_state``.

    Args:
        x: ``(L, C)`` the rows, oldest first.
        weight: ``(C, K)`` depthwise taps (a checkpoint's ``(C, 1, K)`` conv1d weight, squeezed).
        bias: ``(C,)`` or None.
        conv_state: ``(C, K - 1)`` the previous ``K - 1`` inputs (zeros for a fresh sequence); updated
            in place to the last ``K - 1`` inputs after ``x``.
        activation: None or ``"silu"``.

    Returns:
        ``(L, C)`` in ``x``'s dtype: ``y[t, c] = sum_k weight[c, k] * window[c, t + k] + bias[c]``
        over the window ``[conv_state, x^T]`` (torch ``conv1d`` with ``groups=C``).
    """
    channels, kernel = weight.shape
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # (C, K - 1 + L)
    y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels).squeeze(0).t()  # (L, C)
    conv_state.copy_(window[:, window.shape[1] - (kernel - 1):])
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, slots: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """One new row for each of ``B`` sequences, their windows read from and written back to a pool.

    Args:
        x: ``(B, C)`` one row per sequence.
        weight, bias, activation: as in :func:`causal_conv1d_prefill`.
        conv_states: ``(num_slots, C, K - 1)`` the layer's pool of windows.
        slots: ``(B,) int64`` each sequence's slot in ``conv_states``.

    Returns:
        ``(B, C)``, equal to :func:`causal_conv1d_prefill` of each row alone.
    """
    window = torch.cat([conv_states.index_select(0, slots).to(x.dtype), x.unsqueeze(2)], dim=2)  # (B, C, K)
    y = (window * weight.unsqueeze(0)).sum(dim=2)
    if bias is not None:
        y = y + bias
    conv_states.index_copy_(0, slots, window[:, :, 1:].to(conv_states.dtype))
    return F.silu(y) if activation == "silu" else y
