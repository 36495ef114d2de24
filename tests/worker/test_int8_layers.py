"""Weight-only int8 layers checked rank by rank in one process, and the int8 matmul.

The reference is the definition: ``scale[n] = max_k |w[n, k]| / 127`` and
``q = clamp(round(w / scale), -127, 127)`` over the WHOLE row, in float32, written
out here independently of worker/layers/int8_weights.py. Each rank's int8 rows or
columns and its scales must be exactly (bit for bit) the matching slice of the
full layer's, and the ranks' outputs must concatenate (column-parallel) or sum
(row-parallel) to ``x @ (q * scale).T`` of the whole layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.shard_fakes import RecordingSource, ShardOnlyContext
from worker.layers.int8_matmul import int8_linear
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

TPS = [1, 2, 4]
_generator = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_generator)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: (q (N, K) int8, scale (N,) float32) over whole rows."""
    scale = w.float().abs().amax(dim=1) / 127
    q = torch.round(w.float() / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    q, scale = _quantize(w)
    return q.float() * scale[:, None]


def _ctx(rank: int, tp: int) -> ShardOnlyContext:
    return ShardOnlyContext(tp_rank=rank, tp_size=tp, device=torch.device("cpu"))


@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_keeps_whole_row_scales_and_partials_sum(tp: int) -> None:
    weight, bias, x = _randn(16, 48), _randn(16), _randn(5, 48)
    weight[3] = 0.0  # a zero row: scale 0, q 0, no NaN
    weight[5, 40] = 9.0  # row 5's absmax lies in the last rank's columns only
    q_full, scale_full = _quantize(weight)
    size = 48 // tp
    total = torch.zeros(5, 16)
    for rank in range(tp):
        layer = RowParallelLinear(48, 16, _ctx(rank, tp), bias=True, dtype=torch.float32, quantization="int8")
        source = RecordingSource(weight)
        layer.weight.weight_loader(layer.weight, source)
        layer.bias.weight_loader(layer.bias, bias)
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (16,)
        # Quantizing then splitting equals splitting then quantizing: exactly.
        assert torch.equal(layer.weight, q_full[:, rank * size : (rank + 1) * size])
        assert torch.equal(layer.weight_scale, scale_full)
        assert layer.weight_scale.computed_shard_ids == {None}
        assert source.reads[0] == (slice(None), slice(rank * size, (rank + 1) * size))  # its columns for the weight
        total += layer(x[:, rank * size : (rank + 1) * size])
    assert scale_full[3] == 0 and not torch.isnan(total).any()
    torch.testing.assert_close(total - (tp - 1) * bias, F.linear(x, _dequantized(weight), bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", TPS)
def test_merged_column_parallel_splits_scales_with_rows(tp: int) -> None:
    gate, up, x = _randn(24, 16), _randn(24, 16), _randn(5, 16)
    (q_gate, s_gate), (q_up, s_up) = _quantize(gate), _quantize(up)
    gate_parts, up_parts = [], []
    size = 24 // tp
    for rank in range(tp):
        layer = MergedColumnParallelLinear(16, [24, 24], _ctx(rank, tp), bias=False, dtype=torch.float32,
                                           quantization="int8")
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        rows = slice(rank * size, (rank + 1) * size)
        assert torch.equal(layer.weight, torch.cat([q_gate[rows], q_up[rows]]))
        assert torch.equal(layer.weight_scale, torch.cat([s_gate[rows], s_up[rows]]))
        g, u = layer(x).chunk(2, dim=-1)
        gate_parts.append(g)
        up_parts.append(u)
    torch.testing.assert_close(torch.cat(gate_parts, dim=-1), F.linear(x, _dequantized(gate)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(up_parts, dim=-1), F.linear(x, _dequantized(up)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_replicated_kv_head_carries_its_rows_scales(tp: int) -> None:
    heads, d, hidden = 4, 8, 16  # one KV head (MQA): replicated on every rank
    wq, wk, wv, x = _randn(heads * d, hidden), _randn(d, hidden), _randn(d, hidden), _randn(3, hidden)
    q_parts = []
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, 1, _ctx(rank, tp), bias=False, dtype=torch.float32,
                                  quantization="int8")
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            layer.weight.weight_loader(layer.weight, w, shard)
        assert layer.weight_scale.computed_shard_ids == {"q", "k", "v"}
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        torch.testing.assert_close(k, F.linear(x, _dequantized(wk)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, F.linear(x, _dequantized(wv)), atol=1e-5, rtol=1e-5)
        q_parts.append(q)
    torch.testing.assert_close(torch.cat(q_parts, dim=-1), F.linear(x, _dequantized(wq)), atol=1e-5, rtol=1e-5)


def test_quantization_error_is_at_most_half_a_step() -> None:
    weight = _randn(32, 64)
    q, scale = _quantize(weight)
    layer = RowParallelLinear(64, 32, _ctx(0, 1), bias=False, dtype=torch.float32, quantization="int8")
    layer.weight.weight_loader(layer.weight, weight)
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale)
    assert q.abs().max() == 127  # each row's absmax maps to +-127
    error = (layer.weight.float() * layer.weight_scale[:, None] - weight).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("num_tokens, in_features, out_features", [(1, 64, 40), (7, 64, 24), (3, 100, 16), (2, 12, 8)])
def test_int8_linear_equals_the_dequantized_matmul(dtype: torch.dtype, tolerance: float, num_tokens: int,
                                                   in_features: int, out_features: int) -> None:
    # K = 100 and 12 are not multiples of 8: the fallback (torch._weight_int8pack_mm breaks there in bfloat16).
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=_generator)
    scales = torch.rand(out_features, generator=_generator) / 100
    x, bias = _randn(num_tokens, in_features).to(dtype), _randn(out_features).to(dtype)
    y = int8_linear(x, q, scales, bias)
    assert y.dtype == dtype and y.shape == (num_tokens, out_features)
    want = x.double() @ (q.double() * scales.double()[:, None]).T + bias.double()
    assert (y.double() - want).abs().max() <= tolerance * want.abs().max()
