"""The int4 tile layout (worker/layers/int4_matmul.py, pack_tiles; worker/kernels/cpu_linear_int4_tiles.cpp).

* packing: row ``16t + j``'s column ``128c + 4r + i`` lands in the low nibble of byte ``64r + 4j + i`` of block
  ``(t, c)`` and column ``128c + 64 + 4r + i`` in its high nibble (checked on hand-made codes), the scales
  as ``(N / 16, groups, 2, 16)``; :func:`unpack_tiles` inverts it; shapes the layout cannot hold are refused;
* ``torch.ops.tpserve_cpu.linear_int4`` on the tile layout at 1-9, 11, 16, 17, 40, 70 and 130 rows of x (AMX:
  passes of 10 rows at every count; without AMX the VNNI kernel up to 16 rows, dequantized rows and float32
  tiles to 64, then dequantize-and-matmul), groups of 128, 256 and the whole row, with a bias, against
  ``x @ (s * q + o).T + b`` in float64: within 1e-5 of max |y| (x carried as 24-bit fixed point per 128
  columns, as the AMX and VNNI paths of the row-major layout: measured 7e-7 at most);
* on a CPU with AMX-INT8, the VNNI kernel (``use_amx_int4(False)``) gives the AMX kernel's bits at 1-10 rows;
* ``dequantize_int4`` and the Python :func:`dequantize` of the tile layout equal the float64 weights, the
  compiled one the row-major layout's floats bit for bit, and the Python fallback (bfloat16 x) reads it;
* a loaded layer is repacked exactly where :func:`tile_layout_applies` (``use_int4_tiles(False)``: never),
  and a malformed tile-layout scale tensor is refused by the op.

The model-level check (greedy tokens and logits against transformers) is tests/worker/test_int4.py: its tiny
Llama's down projection (256 columns, groups of 128 or the whole row) takes the tile layout at tp 1 and 2.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.int4_checkpoints import SPEC
from tpserve.model_config import ModelConfig
from worker.kernels import cpu_kernels_available
from worker.layers.int4_matmul import (dequantize, int4_linear, is_tile_layout, pack_codes, pack_tiles,
                                       tile_layout_applies, unpack_tiles)
from worker.loader import load_model
from worker.parallel_state import ParallelContext

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the compiled CPU kernels are unavailable")
SHAPES = [(16, 128, 128), (48, 256, 128), (64, 512, 256), (32, 384, 384), (1024, 512, 128)]
ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 11, 16, 17, 40, 70, 130)  # each path of the kernel (module docstring)


def _tiles_enabled() -> bool:
    return cpu_kernels_available() and bool(torch.ops.tpserve_cpu.int4_tiles_enabled())


needs_tiles = pytest.mark.skipif(not _tiles_enabled(),
                                 reason="this CPU has neither AMX-INT8 (given to this process) nor AVX512-VNNI")
needs_amx = pytest.mark.skipif(not (cpu_kernels_available() and torch.ops.tpserve_cpu.use_amx_int4(True)),
                               reason="this CPU (or its kernel) gives this process no AMX-INT8 tiles to compare with")


def _weights(n: int, k: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    so = torch.stack([torch.rand(n, k // g, generator=gen) * 0.1 + 0.01, torch.randn(n, k // g, generator=gen) * 0.1], 2)
    w64 = (q.double().reshape(n, k // g, g) * so[:, :, :1].double() + so[:, :, 1:].double()).reshape(n, k)
    return q, pack_codes(q), so, w64


def test_pack_tiles_puts_codes_in_the_documented_nibbles() -> None:
    n, k = 32, 256
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    q = (rows * 7 + cols * 3) % 16  # a code that tells its row and column apart within each block
    so = torch.arange(n * 2 * 2, dtype=torch.float32).reshape(n, 2, 2)
    packed, scales = pack_tiles(pack_codes(q), so)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8 and scales.shape == (2, 2, 2, 16)
    flat = packed.reshape(-1)
    for t, c, r, j, i in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 3), (0, 1, 7, 9, 2), (1, 0, 3, 4, 1)]:
        byte = int(flat[(t * 2 + c) * 1024 + 64 * r + 4 * j + i])
        row, col = 16 * t + j, 128 * c + 4 * r + i
        assert byte & 0x0F == int(q[row, col]) and byte >> 4 == int(q[row, col + 64]), (t, c, r, j, i)
    assert float(scales[1, 0, 0, 5]) == float(so[21, 0, 0]) and float(scales[1, 1, 1, 5]) == float(so[21, 1, 1])
    codes, back = unpack_tiles(packed, scales)
    assert torch.equal(codes, q.to(torch.uint8)) and torch.equal(back, so) and is_tile_layout(scales)
    with pytest.raises(ValueError, match="tile layout needs"):
        pack_tiles(pack_codes(q[:24]), so[:24])  # 24 rows
    with pytest.raises(ValueError, match="tile layout needs"):
        pack_tiles(pack_codes(q), torch.zeros(n, 4, 2))  # groups of 64


@needs_kernels
@needs_tiles
def test_linear_int4_on_the_tile_layout_matches_float64() -> None:
    ops = torch.ops.tpserve_cpu
    worst = 0.0
    for i, (n, k, g) in enumerate(SHAPES):
        _, packed, so, w64 = _weights(n, k, g, seed=i)
        tq, ts = pack_tiles(packed, so)
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            bias = torch.randn(n, generator=torch.Generator().manual_seed(100 + m))
            ref = x.double() @ w64.T + bias.double()
            for y in (ops.linear_int4(x, tq, ts, bias), ops.linear_int4(x, tq, ts, None) + bias):
                err = float((y.double() - ref).abs().max() / ref.abs().max())
                assert err <= 1e-5, (n, k, g, m, err)
                worst = max(worst, err)
    print(f"tile layout: max error / max |y| = {worst:.2e}")


@needs_kernels
@needs_amx
def test_the_vnni_kernel_gives_the_amx_kernels_bits() -> None:
    ops = torch.ops.tpserve_cpu
    _, packed, so, _ = _weights(64, 512, 128, seed=3)
    tq, ts = pack_tiles(packed, so)
    for m in range(1, 11):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        amx = ops.linear_int4(x, tq, ts, None)
        ops.use_amx_int4(False)
        try:
            vnni = ops.linear_int4(x, tq, ts, None)
        finally:
            ops.use_amx_int4(True)
        assert torch.equal(amx, vnni), m


@needs_kernels
@needs_tiles
def test_a_chunk_of_zeros_and_a_large_outlier_stay_exact() -> None:
    """x's unit is per 128 columns: a zero chunk contributes nothing, an outlier chunk does not blur the others."""
    _, packed, so, w64 = _weights(32, 384, 128, seed=5)
    x = torch.randn(2, 384)
    x[0, :128] = 0.0
    x[0, 128:256] *= 1e-40  # u = max / (127 * 65536) underflows to 0: read as zeros (1e-40 of the rest)
    x[1, 200] = 1e4
    y = torch.ops.tpserve_cpu.linear_int4(x, *pack_tiles(packed, so), None)
    ref = x.double() @ w64.T
    assert float((y.double() - ref).abs().max() / ref.abs().max()) <= 1e-5


@needs_kernels
@needs_tiles
def test_dequantizing_the_tile_layout_gives_the_weights() -> None:
    _, packed, so, w64 = _weights(48, 256, 128, seed=9)
    tq, ts = pack_tiles(packed, so)
    torch.testing.assert_close(torch.ops.tpserve_cpu.dequantize_int4(tq, ts).double(), w64, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dequantize(tq, ts).double(), w64, atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.ops.tpserve_cpu.dequantize_int4(tq, ts), torch.ops.tpserve_cpu.dequantize_int4(packed, so))
    x = torch.randn(3, 256)
    y16 = int4_linear(x.bfloat16(), tq, ts)  # not float32: the Python fallback dequantizes the tile layout
    ref = x.double() @ w64.T
    assert y16.dtype == torch.bfloat16 and float((y16.double() - ref).abs().max() / ref.abs().max()) < 2e-2


@needs_kernels
@needs_tiles
def test_a_malformed_tile_layout_is_refused_by_the_op() -> None:
    _, packed, so, _ = _weights(32, 256, 128, seed=1)
    tq, ts = pack_tiles(packed, so)
    with pytest.raises(RuntimeError, match="tile layout's scale_offset"):
        torch.ops.tpserve_cpu.linear_int4(torch.randn(1, 256), tq, ts[:, :, :, :8].contiguous(), None)
    with pytest.raises(RuntimeError, match="tile layout's scale_offset"):
        torch.ops.tpserve_cpu.linear_int4(torch.randn(1, 256), tq, ts[:1].contiguous(), None)  # 16 rows' scales
    with pytest.raises(RuntimeError, match="tile layout needs N % 16 == 0, K % 128 == 0"):  # 96 columns
        torch.ops.tpserve_cpu.linear_int4(torch.randn(1, 96), torch.zeros(16, 48, dtype=torch.uint8),
                                          torch.ones(1, 1, 2, 16), None)


@needs_kernels
def test_which_layers_take_the_tile_layout() -> None:
    ops = torch.ops.tpserve_cpu
    _, packed, so, _ = _weights(32, 256, 128, seed=2)
    assert tile_layout_applies(packed, so) == _tiles_enabled()
    _, packed64, so64, _ = _weights(32, 256, 64, seed=2)
    assert not tile_layout_applies(packed64, so64)  # groups of 64
    _, packed_k, so_k, _ = _weights(32, 96, 32, seed=2)
    assert not tile_layout_applies(packed_k, so_k)  # 96 columns
    assert not tile_layout_applies(*pack_tiles(packed, so))  # already repacked
    ops.use_int4_tiles(False)
    try:
        assert not tile_layout_applies(packed, so)
    finally:
        ops.use_int4_tiles(True)


@needs_kernels
@needs_tiles
def test_a_loaded_layer_is_repacked_where_the_tile_layout_applies(tmp_path: Path) -> None:
    """The tiny Llama of tests/worker/test_int4.py under ``--quantization int4``: the down projection (64 rows,
    256 columns, RTN groups of 128) takes the tile layout with the same codes and scales as the row-major
    packing of the same weights; q/k/v and gate/up (64 columns) keep the row-major layout."""
    model_dir = save_tiny_model(SPEC, tmp_path / "float")
    config = replace(ModelConfig.from_pretrained(model_dir), quantization="int4")
    mlp = load_model(model_dir, config, ParallelContext.single(), torch.float32).model.layers[1].mlp
    down, gate_up = mlp.down_proj, mlp.gate_up_proj
    assert down.weight_scale.shape == (4, 2, 2, 16) and down.weight.shape == (64, 128)
    assert gate_up.weight_scale.dim() == 3
    torch.ops.tpserve_cpu.use_int4_tiles(False)
    try:
        row_major = load_model(model_dir, config, ParallelContext.single(), torch.float32).model.layers[1].mlp.down_proj
    finally:
        torch.ops.tpserve_cpu.use_int4_tiles(True)
    assert row_major.weight_scale.shape == (64, 2, 2)
    codes, scales = unpack_tiles(down.weight, down.weight_scale)
    assert torch.equal(pack_codes(codes), row_major.weight) and torch.equal(scales, row_major.weight_scale)
