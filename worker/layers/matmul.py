"""``x @ W.T + b`` for the parallel layers, in the form that is fastest for a decode-sized ``x``.

A decode step multiplies a few rows of activations (one per sequence) by every
weight matrix, so its cost is streaming the weights from memory. On the CPU,
``F.linear`` hands MKL the product as ``x (M, K) @ W.T``, which for small ``M``
it splits across threads by rows of ``x``: each thread then reads all of ``W``.
Asking for the transposed product ``W (N, K) @ x.T`` splits the work by rows of
``W``, so each thread streams its own part of the weights once. Measured on a
2-core AVX2 host for the 95M-parameter benchmark model (30 layers, float32,
benchmarks/peer_comparison.py's shapes), all four projections of a step:
``M = 4``: 85 -> 35 ms, ``M = 16``: 90 -> 60 ms, ``M = 64``: 175 -> 125 ms; at
``M = 1`` both forms are the same GEMV, so it keeps ``F.linear``.

CUDA keeps ``F.linear`` (cuBLAS picks its own split, and the transposes would
cost a kernel each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (T, K) @ weight (N, K).T + bias (N,)`` -> ``(T, N)``, contiguous, ``x.dtype``.

    Numerically a GEMM like ``F.linear``'s (float32 accumulation in MKL), with a
    different blocking, so results may differ from ``F.linear`` in the last bits.
    """
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] < 2:
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t().contiguous()  # (T, N)
    if bias is not None:
        y += bias
    return y
