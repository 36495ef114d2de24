"""The parallel layers' GEMM form: the same product as ``F.linear`` for every batch size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import cpu_kernels_available
from worker.layers.matmul import MAX_KERNEL_ROWS, kernel_for_prefill, linear


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 67, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g) if with_bias else None
    y = linear(x, w, b)
    assert y.shape == (rows, 40) and y.is_contiguous() and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    expected = x.double() @ w.double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernel_for_prefill(), reason="not an AMD CPU with AVX-512: prefill stays with MKL here")
def test_prefill_sized_products_take_the_kernel_where_mkl_runs_avx2() -> None:
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(MAX_KERNEL_ROWS + 200, 96, generator=g), torch.randn(40, 96, generator=g)
    # Bitwise: the kernel's own result, not MKL's (which rounds differently).
    assert torch.equal(linear(x, w), torch.ops.tpserve_cpu.linear_f32(x, w, None))
