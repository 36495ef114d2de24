"""The int4 layout and kernel against a float64 reference.

* packing: :func:`pack_codes` puts column ``32b + j`` in the low nibble of byte ``16b + j`` and column
  ``32b + 16 + j`` in its high nibble (checked on hand-made codes), and :func:`unpack_codes` inverts it;
* ``torch.ops.tpserve_cpu.linear_int4`` on each path the CPU has (AMX-INT8, AVX-512 VNNI, AVX-512 float, AVX2,
  and without AMX the dequantized rows' tiles from 9 rows of x), at 1-9, 17 and 70 rows of x (streamed, chunked,
  and the dequantize-and-matmul of prefill), group
  sizes 32, 64, 128, 256 and the whole row, with a bias: against ``x @ (s * q + o).T + b`` in float64.
  Bound, relative to max |y|: 1e-5 on every path (float32 accumulation; the AMX and VNNI paths carry
  x as 24-bit fixed point per 128 columns, exact to 6e-8 of a chunk's largest |x|: measured 5e-7 on
  each path); the AMX path takes the shapes whose rows divide by 16 and groups by 128;
* the Python fallback (:func:`int4_linear` without the compiled kernels) to 1e-5;
* ``dequantize_int4`` equals the float64 weights to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from worker.kernels import cpu_kernels_available
from worker.layers.int4_matmul import dequantize, int4_linear, pack_codes, unpack_codes

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the compiled CPU kernels are unavailable")
SHAPES = [(40, 64, 32), (37, 128, 64), (40, 256, 128), (64, 512, 256), (24, 384, 384), (48, 256, 128), (32, 384, 384)]
ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 17, 70)  # AMX: 5 a pass; VNNI: up to 4; the float paths: 8 a pass; row tiles: 9-64;
# dequantize: over 64


def _weights(n: int, k: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    so = torch.stack([torch.rand(n, k // g, generator=gen) * 0.1 + 0.01, torch.randn(n, k // g, generator=gen) * 0.1], 2)
    w64 = (q.double().reshape(n, k // g, g) * so[:, :, :1].double() + so[:, :, 1:].double()).reshape(n, k)
    return pack_codes(q), so, w64


def test_packing_puts_columns_in_the_documented_nibbles() -> None:
    q = torch.arange(64).remainder(16).reshape(1, 64)  # column c holds c % 16
    packed = pack_codes(q)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    for block in range(2):
        for j in range(16):
            byte = int(packed[0, 16 * block + j])
            assert byte & 0x0F == (32 * block + j) % 16 and byte >> 4 == (32 * block + 16 + j) % 16
    codes = torch.randint(0, 16, (5, 96))
    assert torch.equal(unpack_codes(pack_codes(codes)), codes.to(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_codes(torch.zeros(2, 48, dtype=torch.long))


def _paths() -> list[tuple[str, bool, bool, bool, bool]]:
    """(name, AVX-512, VNNI, AMX, the dequantized rows' tiles from 9 rows of x)."""
    return [("amx", True, True, True, True), ("vnni", True, True, False, False),
            ("row_tiles", True, True, False, True), ("avx512", True, False, False, False),
            ("avx2", False, False, False, False)]


@needs_kernels
@pytest.mark.parametrize("path,wide,vnni,amx,tiles", _paths())
def test_linear_int4_matches_float64(path: str, wide: bool, vnni: bool, amx: bool, tiles: bool) -> None:
    ops = torch.ops.tpserve_cpu
    if wide and not ops.use_avx512_int4(True):
        pytest.skip("this CPU has no AVX-512 (F, VL, BW)")
    if vnni and not ops.use_vnni_int4(True):
        pytest.skip("this CPU has no AVX512-VNNI")
    if amx and not ops.use_amx_int4(True):
        pytest.skip("this CPU (or its kernel) gives this process no AMX-INT8 tiles")
    ops.use_avx512_int4(wide)
    ops.use_vnni_int4(vnni)
    ops.use_amx_int4(amx)
    ops.use_int4_row_tiles(tiles)
    try:
        worst = 0.0
        for i, (n, k, g) in enumerate(SHAPES):
            packed, so, w64 = _weights(n, k, g, seed=i)
            for m in ROWS:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                bias = torch.randn(n, generator=torch.Generator().manual_seed(100 + m))
                y = ops.linear_int4(x, packed, so, bias)  # (m, n)
                ref = x.double() @ w64.T + bias.double()
                err = float((y.double() - ref).abs().max() / ref.abs().max())
                assert err <= 1e-5, (path, n, k, g, m, err)
                worst = max(worst, err)
        print(f"{path}: max error / max |y| = {worst:.2e}")
    finally:
        ops.use_avx512_int4(True)
        ops.use_vnni_int4(True)
        ops.use_amx_int4(True)
        ops.use_int4_row_tiles(True)


@needs_kernels
def test_dequantize_int4_is_the_weights() -> None:
    packed, so, w64 = _weights(37, 256, 64, seed=9)
    torch.testing.assert_close(torch.ops.tpserve_cpu.dequantize_int4(packed, so).double(), w64, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dequantize(packed, so).double(), w64, atol=1e-6, rtol=1e-6)


def test_the_python_fallback_matches_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.layers.int4_matmul as int4_matmul

    monkeypatch.setattr(int4_matmul, "cpu_kernels_available", lambda: False)
    packed, so, w64 = _weights(40, 128, 32, seed=4)
    x = torch.randn(3, 128)
    y = int4_linear(x, packed, so)
    ref = x.double() @ w64.T
    assert float((y.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    y16 = int4_linear(x.bfloat16(), packed, so)  # another dtype: dequantized to it
    assert y16.dtype == torch.bfloat16 and float((y16.double() - ref).abs().max() / ref.abs().max()) < 2e-2
