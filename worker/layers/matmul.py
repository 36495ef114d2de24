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
``M = 1`` both forms are the same GEMV, so it keeps ``F.linear``, and from 128 rows
on (prefill) ``F.linear``'s blocking is faster again (128 rows: 7.9 against 11.4 ms
a layer; 512 rows: 38 against 163 ms).

Where the CPU has AVX2 and the kernels built (worker/kernels/), float32 products
of up to ``MAX_KERNEL_ROWS`` rows go to ``torch.ops.tpserve_cpu.linear_f32``
instead, which reads every weight exactly once per call whatever the row count
and splits the weight rows between threads (worker/kernels/cpu_linear.cpp says
why MKL does not). Prefill-sized products stay with MKL, whose cache blocking
wins once the product is compute-bound, except on AMD CPUs with AVX-512
(:func:`kernel_for_prefill`): MKL runs its AVX2 code there, and the kernel's
AVX-512 path is faster at every row count. Measured on a Zen 5 core, one thread,
the 95M model's projection shapes: MKL 73-90 GFLOP/s at 128-2048 rows, the kernel
112-153 (worker/kernels/cpu_linear.cpp blocks x's rows for it).

A layer held in its checkpoint's 16 bits (worker/layers_w16.py) takes ``linear_w16`` where a float32 one takes
``linear_f32``, and a widened copy where a float32 one goes to MKL: the same products.

CUDA keeps ``F.linear`` (cuBLAS picks its own split, and the transposes would
cost a kernel each).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from worker.kernels import cpu_kernels_available

#: Most rows of ``x`` sent to the compiled kernel; above it MKL's blocked GEMM is as fast or faster
#: (except where :func:`kernel_for_prefill`).
MAX_KERNEL_ROWS = 64


@functools.cache
def kernel_for_prefill() -> bool:
    """Whether float32 products of any row count go to the compiled kernel: an AMD CPU with AVX-512.

    MKL dispatches its AVX-512 GEMMs on Intel CPUs only; on AMD it runs AVX2 code at about
    half of what the kernel's AVX-512 path reaches (module docstring). Read from
    ``/proc/cpuinfo`` (Linux); False where it cannot be read.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            info = cpuinfo.read(65536)  # the first CPU's block is enough
    except OSError:
        return False
    return "AuthenticAMD" in info and " avx512f" in info and " avx512vl" in info


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (T, K) @ weight (N, K).T + bias (N,)`` -> ``(T, N)``, contiguous, ``x.dtype``.

    Numerically a GEMM like ``F.linear``'s (float32 accumulation), with a
    different blocking, so results may differ from ``F.linear`` in the last bits.
    ``weight`` must be contiguous (the layers' parameters are). A bfloat16 or float16 ``weight`` with float32
    ``x`` (a layer held 16-bit on a CPU: worker/layers_w16.py) gives the bits of ``linear(x, weight.float(),
    bias)``: the compiled ``linear_w16`` widens it as it reads it.
    """
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):  # worker/layers_w16.py
        if x.shape[0] <= MAX_KERNEL_ROWS or kernel_for_prefill():
            return torch.ops.tpserve_cpu.linear_w16(x.contiguous(), weight, bias)  # linear_f32's bits, widened as read
        return linear(x, weight.float(), bias)  # prefill-sized: the float32 layer's own product, on a widened copy
    if ((x.shape[0] <= MAX_KERNEL_ROWS or kernel_for_prefill()) and x.dtype == weight.dtype == torch.float32
            and cpu_kernels_available() and (bias is None or bias.dtype == torch.float32)):
        return torch.ops.tpserve_cpu.linear_f32(x.contiguous(), weight, bias)  # (T, N)
    if x.shape[0] < 2 or x.shape[0] > MAX_KERNEL_ROWS:  # a GEMV, or a prefill-sized GEMM MKL blocks well
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t().contiguous()  # (T, N)
    if bias is not None:
        y += bias
    return y
