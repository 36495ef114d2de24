"""gpt-oss's experts' activation: a SwiGLU whose gate and up inputs are clamped, with a sigmoid gain.

For a ``(rows, 2 * I)`` gate/up output laid out ``[gate | up]`` (the checkpoint interleaves
them; worker/layers/moe_stacked.py de-interleaves at load):

    gate = min(gate, limit)                      clamped above only
    up   = clamp(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)

Reference: ``transformers``' ``modeling_gpt_oss.py`` (``GptOssExperts._apply_gate``), from
OpenAI's gpt-oss release (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0 by default). The clamp
bounds the activations of a model trained in low precision; the ``+ 1`` on ``up`` makes the
unit a residual-like gate. Used by both expert paths (torch, Triton) through
worker/layers/moe_experts.py's ``act`` argument.
"""

from __future__ import annotations

import torch
from torch import nn


class ClampedSwiGLU(nn.Module):
    """``(up + 1) * gate * sigmoid(alpha * gate)`` of clamped ``gate, up``.

    Args:
        alpha: the sigmoid's gain (``swiglu_alpha``), > 0.
        limit: the clamp (``swiglu_limit``), > 0.

    Shapes: ``gate_up (rows, 2 * I)`` ``[gate | up]`` -> ``(rows, I)``, same dtype.

    Raises:
        ValueError: ``alpha`` or ``limit`` not > 0.
    """

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        if not alpha > 0 or not limit > 0:
            raise ValueError(f"swiglu_alpha={alpha} and swiglu_limit={limit} must be > 0")
        self.alpha = float(alpha)
        self.limit = float(limit)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # (rows, I) each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # (rows, I)
