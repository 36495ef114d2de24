"""Tensor-parallel layers checked rank by rank in one process.

Each layer is built for rank ``r`` of a ``tp``-way group whose collectives do
nothing, loaded through its ``weight_loader`` from the full weight, and run: its
output is rank ``r``'s partial. The partials must concatenate (column-parallel,
QKV, LM head) or sum (row-parallel, embedding) to the full layer's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.shard_fakes import RecordingSource, ShardOnlyContext
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker.parallel_state import ParallelContext

TPS = [2, 4]
DTYPE = torch.float32


def _ctx(rank: int, tp: int) -> ShardOnlyContext:
    return ShardOnlyContext(tp_rank=rank, tp_size=tp, device=torch.device("cpu"))


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_randn.generator)


_randn.generator = torch.Generator().manual_seed(0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("tp", TPS)
def test_column_parallel_partials_concatenate(tp: int) -> None:
    weight, bias, x = _randn(24, 16), _randn(24), _randn(5, 16)
    parts = []
    for rank in range(tp):
        layer = ColumnParallelLinear(16, 24, _ctx(rank, tp), bias=True, dtype=DTYPE)
        source = RecordingSource(weight)
        layer.weight.weight_loader(layer.weight, source)
        layer.bias.weight_loader(layer.bias, bias)
        size = 24 // tp
        assert source.reads == [(slice(rank * size, (rank + 1) * size), slice(None))]  # only its rows
        parts.append(layer(x))  # (5, 24 / tp)
    torch.testing.assert_close(torch.cat(parts, dim=-1), F.linear(x, weight, bias))


@pytest.mark.parametrize("tp", TPS)
def test_merged_column_parallel_partials_concatenate(tp: int) -> None:
    gate, up, x = _randn(24, 16), _randn(24, 16), _randn(5, 16)
    gate_parts, up_parts = [], []
    for rank in range(tp):
        layer = MergedColumnParallelLinear(16, [24, 24], _ctx(rank, tp), bias=False, dtype=DTYPE)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g, u = layer(x).chunk(2, dim=-1)  # (5, 24 / tp) each: [gate | up] layout
        gate_parts.append(g)
        up_parts.append(u)
    torch.testing.assert_close(torch.cat(gate_parts, dim=-1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat(up_parts, dim=-1), F.linear(x, up))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("total_num_kv_heads", [4, 2, 1])
def test_qkv_parallel_splits_heads_and_replicates_kv(tp: int, total_num_kv_heads: int) -> None:
    heads, d, hidden = 8, 4, 16
    kv_size = total_num_kv_heads * d
    wq, wk, wv = _randn(heads * d, hidden), _randn(kv_size, hidden), _randn(kv_size, hidden)
    bq, bk, bv = _randn(heads * d), _randn(total_num_kv_heads * d), _randn(total_num_kv_heads * d)
    x = _randn(3, hidden)
    full_q, full_k, full_v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
    q_parts = []
    group = heads // total_num_kv_heads  # query heads per KV head
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, total_num_kv_heads, _ctx(rank, tp), bias=True, dtype=DTYPE)
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight.weight_loader(layer.weight, w, shard)
            layer.bias.weight_loader(layer.bias, b, shard)
        assert layer.num_kv_heads == max(1, total_num_kv_heads // tp)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        q_parts.append(q)
        # The KV heads a rank holds are exactly those its query heads attend to (GQA).
        query_heads = range(rank * layer.num_heads, (rank + 1) * layer.num_heads)
        kv_heads = sorted({h // group for h in query_heads})
        assert kv_heads == list(range(layer.kv_head_start, layer.kv_head_start + layer.num_kv_heads))
        cols = slice(kv_heads[0] * d, (kv_heads[-1] + 1) * d)
        torch.testing.assert_close(k, full_k[:, cols])
        torch.testing.assert_close(v, full_v[:, cols])
    torch.testing.assert_close(torch.cat(q_parts, dim=-1), full_q)


@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_partials_sum(tp: int) -> None:
    weight, bias, x = _randn(16, 24), _randn(16), _randn(5, 24)
    size = 24 // tp
    total = torch.zeros(5, 16)
    for rank in range(tp):
        layer = RowParallelLinear(24, 16, _ctx(rank, tp), bias=True, dtype=DTYPE)
        source = RecordingSource(weight)
        layer.weight.weight_loader(layer.weight, source)
        layer.bias.weight_loader(layer.bias, bias)
        assert source.reads == [(slice(None), slice(rank * size, (rank + 1) * size))]  # only its columns
        total += layer(x[:, rank * size : (rank + 1) * size])  # partial + bias (reduce is identity here)
    # The bias is added once after the all-reduce, so each identity-reduced rank carries it once.
    torch.testing.assert_close(total - (tp - 1) * bias, F.linear(x, weight, bias))


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embedding_partials_sum(tp: int) -> None:
    vocab, hidden = 130, 8  # 130 is not a multiple of 4: the last rank holds padding rows
    weight = _randn(vocab, hidden)
    ids = torch.tensor([0, 1, 31, 32, 33, 64, 65, 97, 128, 129])
    total = torch.zeros(len(ids), hidden)
    for rank in range(tp):
        layer = VocabParallelEmbedding(vocab, hidden, _ctx(rank, tp), dtype=DTYPE)
        layer.weight.weight_loader(layer.weight, weight)
        assert layer.padded_vocab_size % tp == 0 and layer.padded_vocab_size >= vocab
        total += layer(ids)
    torch.testing.assert_close(total, F.embedding(ids, weight))


@pytest.mark.parametrize("tp", TPS)
def test_lm_head_partials_concatenate_without_padding(tp: int) -> None:
    vocab, hidden = 130, 8
    weight, x = _randn(vocab, hidden), _randn(3, hidden)
    parts = []
    for rank in range(tp):
        head = ParallelLMHead(vocab, hidden, _ctx(rank, tp), dtype=DTYPE)
        head.weight.weight_loader(head.weight, weight)
        parts.append(head(x))  # the rank's local logits (identity gather), padding columns included
    logits = torch.cat(parts, dim=-1)  # (3, padded_vocab)
    padded = head.padded_vocab_size
    assert logits.shape == (3, padded)
    torch.testing.assert_close(logits[:, :vocab], F.linear(x, weight))
    assert torch.all(logits[:, vocab:] == 0)  # padding rows are zero


def test_lm_head_forward_drops_padding_columns() -> None:
    head = ParallelLMHead(130, 8, ParallelContext.single(), dtype=DTYPE)
    weight, x = _randn(130, 8), _randn(3, 8)
    head.weight.weight_loader(head.weight, weight)
    torch.testing.assert_close(head(x), F.linear(x, weight))


def test_tied_lm_head_shares_the_embedding_parameter() -> None:
    ctx = _ctx(1, 2)
    embedding = VocabParallelEmbedding(130, 8, ctx, dtype=DTYPE)
    head = ParallelLMHead(130, 8, ctx, dtype=DTYPE)
    head.tie_to(embedding)
    assert head.weight is embedding.weight


def test_loader_rejects_wrong_shapes() -> None:
    layer = ColumnParallelLinear(16, 24, _ctx(0, 2), bias=False, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"shape \[24, 15\], expected \[24, 16\]"):
        layer.weight.weight_loader(layer.weight, _randn(24, 15))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("total_num_kv_heads", [4, 1])
def test_fused_checkpoint_tensors_load_like_their_parts(tp: int, total_num_kv_heads: int) -> None:
    """A fused ``qkv_proj`` / ``gate_up_proj`` (Phi-3; ``shard_id=None``) fills each rank as its parts
    would, reading only that rank's rows of each part."""
    heads, d, hidden, inter = 8, 4, 16, 24
    kv_rows = total_num_kv_heads * d
    wq, wk, wv = _randn(heads * d, hidden), _randn(kv_rows, hidden), _randn(kv_rows, hidden)
    gate, up = _randn(inter, hidden), _randn(inter, hidden)
    for rank in range(tp):
        split = QKVParallelLinear(hidden, d, heads, total_num_kv_heads, _ctx(rank, tp), bias=False, dtype=DTYPE)
        fused = QKVParallelLinear(hidden, d, heads, total_num_kv_heads, _ctx(rank, tp), bias=False, dtype=DTYPE)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            split.weight.weight_loader(split.weight, w, shard)
        source = RecordingSource(torch.cat([wq, wk, wv]))
        fused.weight.weight_loader(fused.weight, source, None)
        assert torch.equal(fused.weight, split.weight)
        assert sum(read[0].stop - read[0].start for read in source.reads) == split.weight.shape[0]  # its rows only
        merged_split = MergedColumnParallelLinear(hidden, [inter, inter], _ctx(rank, tp), bias=False, dtype=DTYPE)
        merged_fused = MergedColumnParallelLinear(hidden, [inter, inter], _ctx(rank, tp), bias=False, dtype=DTYPE)
        merged_split.weight.weight_loader(merged_split.weight, gate, 0)
        merged_split.weight.weight_loader(merged_split.weight, up, 1)
        merged_fused.weight.weight_loader(merged_fused.weight, torch.cat([gate, up]), None)
        assert torch.equal(merged_fused.weight, merged_split.weight)
    with pytest.raises(ValueError, match=r"fused checkpoint tensor has shape \[47, 16\], expected 48 rows"):
        merged_fused.weight.weight_loader(merged_fused.weight, _randn(47, hidden), None)
