"""What both experts paths share (the torch one, worker/layers/moe_experts.py, and the Triton one,
worker/kernels/triton_moe.py): the experts' activation and the weighted sum of a token's ``k`` outputs.
A module of its own so that the Triton kernel does not import the layer that dispatches to it.
"""

from __future__ import annotations

import torch

from worker.layers.norm import SiluAndMul

#: The experts' SwiGLU: ``silu(gate) * up`` of a ``(rows, 2 * I)`` gate/up output.
expert_act = SiluAndMul()


def combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[:, j] * expert_out[:, j]``: ``(T, k, H), (T, k) -> (T, H)`` in ``expert_out.dtype``.

    Products in the promoted dtype (float32 routing weights lift a bfloat16 output, as
    in ``transformers``' Mixtral), summed in float32, rounded once.
    """
    scaled = expert_out * weights.unsqueeze(-1)  # (T, k, H)
    return scaled.sum(dim=1, dtype=torch.float32).to(expert_out.dtype)  # (T, H)
