"""The one matmul of weight-only int8 layers: ``y = (x @ qweight.T) * scales + bias``.

Every int8 linear layer calls :func:`int8_linear` and nothing else, so that a faster
kernel (a compiled CPU kernel, torchao, a Triton kernel on CUDA) replaces this body
without touching the layers. The layout it takes is fixed: ``qweight (N, K)`` int8,
row-major and contiguous (one output channel per row, as ``nn.Linear`` stores its
weight), and ``scales (N,)`` float32, one per output channel (``w ~= qweight *
scales[:, None]``; worker/layers/int8_weights.py).

With float32 activations on a CPU with the compiled kernels (worker/kernels/), the
product is ``torch.ops.tpserve_cpu.linear_int8``: each int8 row is read once, widened
in L1 and multiplied into every row of ``x``, with the scale applied to each dot
product (float32 accumulation), at any row count. Elsewhere: on the CPU,
``torch._weight_int8pack_mm`` (PyTorch's
weight-only int8 GEMM, the kernel behind torchao's CPU int8 weight-only path) where it
is known to be correct, else dequantize-then-matmul. ``_weight_int8pack_mm`` in
PyTorch 2.13 needs ``K`` to be a multiple of 8 in bfloat16: with ``K = 12`` or ``100``
it returned garbage or crashed the process (measured here), so the rule below keeps
every dtype on the fallback unless ``K % 8 == 0``.
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_kernels_available

#: ``x.dtype`` values ``torch._weight_int8pack_mm`` takes on the CPU.
_PACK_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``K`` must be a multiple of this for ``torch._weight_int8pack_mm`` (see the module docstring).
_PACK_MM_K_MULTIPLE = 8


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only int8 linear: ``x @ (qweight * scales[:, None]).T + bias``.

    Args:
        x: ``(T, K)`` activations in the model dtype (float32, bfloat16, float16).
        qweight: ``(N, K)`` int8, contiguous (row-major).
        scales: ``(N,)`` float32, the per-output-channel scales.
        bias: ``(N,)`` in ``x.dtype``, or None.

    Returns:
        ``(T, N)`` in ``x.dtype``. Accumulation is float32 on the CPU for float32
        activations; for half-precision activations ``_weight_int8pack_mm`` applies
        the scales in ``x.dtype`` (rounded to it), the fallback in float32.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_kernels_available():
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        return torch.ops.tpserve_cpu.linear_int8(x.contiguous(), qweight, scales, bias)  # (T, N)
    if (x.device.type == "cpu" and x.dtype in _PACK_MM_DTYPES and x.dim() == 2
            and qweight.shape[1] % _PACK_MM_K_MULTIPLE == 0):
        y = torch._weight_int8pack_mm(x.contiguous(), qweight, scales.to(x.dtype))  # (T, N)
    else:
        y = (torch.mm(x, qweight.to(x.dtype).t()) * scales).to(x.dtype)  # (T, N)
    if bias is not None:
        y = y + bias  # (T, N)
    return y
