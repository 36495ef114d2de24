"""Packed int4 codes: the layout the int4 kernel reads, packing into it, and the one int4 matmul.

Layout (the compiled kernel's, worker/kernels/cpu_linear_int4.cpp; every int4 source is
repacked into it at load, worker/layers/int4_weights.py):

* ``qweight (N, K / 2)`` uint8: codes ``q`` in ``[0, 15]``, in blocks of 32 columns; block
  ``b`` is bytes ``16b .. 16b + 15``, byte ``j`` holding column ``32b + j`` in its low nibble
  and column ``32b + 16 + j`` in its high nibble (two masks give two runs of 16 columns).
* ``scale_offset (N, K / G, 2)`` float32: per row and group of ``G`` columns (a multiple of
  32 dividing ``K``), ``(s, o)`` with ``w = s * q + o``; a zero point ``z`` is ``o = -s * z``.

So a weight costs 4 bits plus ``64 / G`` bits of scale and offset: 4.5 bits at ``G = 128``.
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_kernels_available

#: Columns per 16-byte block of codes.
BLOCK = 32


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` integer codes in ``[0, 15]`` -> ``(N, K / 2)`` uint8 in the kernel's block layout.

    Raises:
        ValueError: ``K`` is not a multiple of 32, or a code is outside ``[0, 15]``.
    """
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"int4 layout needs the input size to be a multiple of {BLOCK}, got {k}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 codes must lie in [0, 15]")
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)  # (N, blocks, low/high half, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``(N, K / 2)`` uint8 -> ``(N, K)`` uint8 codes."""
    n, half = qweight.shape
    blocks = qweight.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


def dequantize(qweight: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    """``w = s * q + o`` as float32 ``(N, K)`` (the reference the kernel is tested against)."""
    q = unpack_codes(qweight).float()  # (N, K)
    n, k = q.shape
    groups = scale_offset.shape[1]
    q = q.reshape(n, groups, k // groups)
    return (q * scale_offset[:, :, :1] + scale_offset[:, :, 1:]).reshape(n, k)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int4 linear: ``x @ W.T + bias`` with ``W = s * q + o`` group-wise (module docstring).

    Args:
        x: ``(T, K)`` activations in the model dtype.
        qweight: ``(N, K / 2)`` uint8, packed codes.
        scale_offset: ``(N, K / G, 2)`` float32.
        bias: ``(N,)`` or None.

    Returns:
        ``(T, N)`` in ``x.dtype``. float32 activations on a CPU with the compiled kernels take
        ``torch.ops.tpserve_cpu.linear_int4`` (codes widened in registers, float32 accumulation);
        elsewhere W is dequantized to ``x.dtype`` and multiplied by torch (a fallback: it reads
        W as floats).
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_kernels_available():
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        return torch.ops.tpserve_cpu.linear_int4(x.contiguous(), qweight, scale_offset, bias)  # (T, N)
    w = dequantize(qweight, scale_offset).to(x.dtype)  # (N, K)
    return torch.nn.functional.linear(x, w, bias)  # (T, N)
