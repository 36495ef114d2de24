"""worker/kv_quant.py's row quantization and worker/kv_cache.py's bytes per block of an 8-bit cache: each
(token, KV head) row with its own bfloat16 scale, the key offset exact, and what "2x the blocks" becomes."""

from __future__ import annotations

import pytest
import torch

from tpserve.model_config import KVCacheSpec
from worker.kv_cache import KVCacheLayout
from worker.kv_quant import QMAX, SCALE_DTYPE, SCALE_FLOOR, as_cached, dequantize, quantize

EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)


def _rows() -> torch.Tensor:
    """``(5, 2, 16)`` rows of very different ranges (1e-3 .. 1e3), one all zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 1.0]).view(5, 1, 1)
    x[4, 1] = 0.0
    return x


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_each_row_gets_its_own_scale(dtype: torch.dtype) -> None:
    """A row's scale is its absmax over qmax (bfloat16, rounded to nearest), whatever the other rows hold; an
    all-zero row gets the floor's scale and zero codes; every row's error is bounded by its own range."""
    x = _rows()
    codes, scales = quantize(x, dtype)
    assert codes.dtype == dtype and codes.shape == x.shape
    assert scales.dtype == SCALE_DTYPE and scales.shape == (5, 2)
    want = (x.abs().amax(-1).clamp_min(SCALE_FLOOR) / QMAX[dtype]).to(SCALE_DTYPE)
    assert torch.equal(scales, want) and bool((scales.float() > 0).all())
    assert codes[4, 1].float().abs().max() == 0
    back = dequantize(codes, scales, torch.float32)
    err = (back - x).abs()
    absmax = x.abs().amax(-1, keepdim=True)  # (5, 2, 1)
    if dtype == torch.int8:  # half a step of the row's own scale (with the bfloat16 rounding's slack)
        assert bool((err <= absmax / 254 * (1 + 2**-7)).all())
        assert float(err.amax(-1).div(absmax.squeeze(-1).clamp_min(1e-30))[:4].max()) > 1e-3  # and not exact
    else:  # e4m3: relative to each element, 2^-4 in its normal range (|x / s| >= 2^-6)
        normal = x.abs() >= absmax / QMAX[dtype] * 2**-6
        assert bool((err[normal] <= x.abs()[normal] * 2**-4).all())
    # A per-tensor scale would give the 1e-3 row nothing: here it keeps its own resolution.
    assert float((back[0] - x[0]).abs().max()) < 1e-3 * 0.1


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_the_key_offset_is_added_back_exactly_and_only_buys_resolution(dtype: torch.dtype) -> None:
    """Rows riding on a large per-channel offset: quantized less the offset, their error shrinks to the
    deviations' scale (the offset is restored exactly; ``as_cached`` is the round trip)."""
    g = torch.Generator().manual_seed(1)
    offset = torch.randn(2, 16, generator=g) * 50
    x = torch.randn(64, 2, 16, generator=g) + offset  # deviations of ~1 around offsets of ~50
    plain = (as_cached(x, dtype) - x).abs().mean()
    centred = (as_cached(x, dtype, offset) - x).abs().mean()
    assert float(centred) < float(plain) / 10
    codes, scales = quantize(x, dtype, offset)
    assert torch.equal(dequantize(codes, scales, torch.float32, offset), as_cached(x, dtype, offset))
    assert float(scales.float().max()) < 5 / QMAX[dtype]  # the deviations' range, not the offset's


@pytest.mark.parametrize("head_dim, ratio", [(8, 1.60), (16, 1.78), (64, 1.94), (128, 1.97)])
def test_an_8_bit_block_is_2d_over_d_plus_2_of_a_16_bit_one(head_dim: int, ratio: float) -> None:
    """Codes of 1 byte and a 2-byte scale per (token, KV head) against 2 bytes per element: a budget holds
    ``2d / (d + 2)`` times the blocks (rounded down), the figure the issue's "2x" becomes."""
    spec = KVCacheSpec("per_head", (4, head_dim), (4, head_dim))
    eight, sixteen = KVCacheLayout(3, 16, spec, torch.int8), KVCacheLayout(3, 16, spec, torch.bfloat16)
    assert eight.bytes_per_block == 3 * 16 * 2 * 4 * (head_dim + 2)
    assert sixteen.bytes_per_block == 3 * 16 * 2 * 4 * head_dim * 2
    budget = 2**30
    got = eight.num_blocks_for_budget(budget) / sixteen.num_blocks_for_budget(budget)
    assert got == pytest.approx(2 * head_dim / (head_dim + 2), abs=1e-3) and round(got, 2) == ratio
    pools = eight.allocate_scales(5, torch.device("cpu"))
    assert len(pools) == 3 and all(p.shape == (5, 4, 16) and p.dtype == SCALE_DTYPE for pair in pools for p in pair)
    with pytest.raises(ValueError, match="scales are for an 8-bit cache"):
        sixteen.allocate_scales(5, torch.device("cpu"))
