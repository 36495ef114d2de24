"""Paged attention: step metadata, and a mixed prefill/decode batch against plain causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.attention import AttentionMetadata, PagedAttention

BLOCK_SIZE = 4
HEADS, KV_HEADS, D = 4, 2, 8
# Three sequences: a fresh 5-token prefill, a decode at position 9, a 3-token chunk from position 4.
QUERY_LENS = [5, 1, 3]
STARTS = [0, 9, 4]
TABLES = [[7, 2], [0, 5, 3], [6, 1]]


def _metadata() -> AttentionMetadata:
    return AttentionMetadata.build(QUERY_LENS, STARTS, TABLES, BLOCK_SIZE, torch.device("cpu"))


def test_metadata_positions_slots_and_batches() -> None:
    meta = _metadata()
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 9, 4, 5, 6]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 8, 13, 4, 5, 6]
    assert meta.context_lens.tolist() == [5, 10, 7]
    assert meta.query_start_loc.tolist() == [0, 5, 6, 9]
    decode, prefill = meta.batches
    assert (decode.num_seqs, decode.max_query_len, decode.max_kv_len) == (1, 1, 10)
    assert (prefill.num_seqs, prefill.max_query_len, prefill.max_kv_len) == (2, 5, 7)
    assert prefill.output_tokens.tolist() == [0, 1, 2, 3, 4, 6, 7, 8]


def test_too_few_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="need 3 blocks of 4, table has 2"):
        AttentionMetadata.build([3], [7], [[0, 1]], BLOCK_SIZE, torch.device("cpu"))


def test_mixed_batch_equals_causal_attention_over_each_history() -> None:
    generator = torch.Generator().manual_seed(0)
    meta = _metadata()
    k_cache = torch.zeros(8, BLOCK_SIZE, KV_HEADS, D)
    v_cache = torch.zeros(8, BLOCK_SIZE, KV_HEADS, D)
    # Earlier steps left each sequence's history (positions before its start) in its blocks.
    histories = []
    for start, qlen, table in zip(STARTS, QUERY_LENS, TABLES):
        k_all = torch.randn(start + qlen, KV_HEADS, D, generator=generator)  # (L, KVH, D)
        v_all = torch.randn(start + qlen, KV_HEADS, D, generator=generator)
        for pos in range(start):
            k_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k_all[pos]
            v_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v_all[pos]
        histories.append((k_all, v_all))
    q = torch.randn(sum(QUERY_LENS), HEADS, D, generator=generator)  # (T, H, D)
    k_new = torch.cat([k[s:] for (k, _), s in zip(histories, STARTS)])  # (T, KVH, D)
    v_new = torch.cat([v[s:] for (_, v), s in zip(histories, STARTS)])
    out = PagedAttention(HEADS, KV_HEADS, D, scale=D**-0.5)(q, k_new, v_new, k_cache, v_cache, meta)  # (T, H*D)

    expected, offset = [], 0
    for (k_all, v_all), start, qlen in zip(histories, STARTS, QUERY_LENS):
        qs = q[offset : offset + qlen].transpose(0, 1)  # (H, Q, D)
        ks = k_all.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # (H, L, D)
        vs = v_all.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        mask = torch.arange(start + qlen)[None, :] <= torch.arange(start, start + qlen)[:, None]  # (Q, L)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)  # (H, Q, D)
        expected.append(o.transpose(0, 1).reshape(qlen, HEADS * D))
        offset += qlen
    torch.testing.assert_close(out, torch.cat(expected))
    assert not torch.isnan(out).any()
