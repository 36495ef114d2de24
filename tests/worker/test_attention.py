"""Paged attention and the step inputs: a mixed prefill/decode batch against plain causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.step import SamplingParams, ScheduledChunk
from worker.attention import PagedAttention, write_kv_cache
from worker.kernels import cpu_kernels_available
from worker.step_inputs import build_step_inputs

BLOCK_SIZE = 4
HEADS, KV_HEADS, D = 4, 2, 8
# In plan order: a fresh 5-token prefill, a decode at position 9, a 3-token chunk from
# position 4 (a continued prompt), a decode at position 2.
QUERY_LENS = [5, 1, 3, 1]
STARTS = [0, 9, 4, 2]
TABLES = [[7, 2], [0, 5, 3], [6, 1], [4]]
SAMPLE = [True, True, False, True]


def _inputs(device: str = "cpu", with_sampling: bool = True, paged_kernel: bool = False):
    chunks = [ScheduledChunk(i, tuple(range(10 * i, 10 * i + n)), s, sample=smp)
              for i, (n, s, smp) in enumerate(zip(QUERY_LENS, STARTS, SAMPLE))]
    sampling = [SamplingParams(temperature=0.5 * i, top_k=i, top_p=1.0 - 0.1 * i, seed=2**64 - 1 - i) for i in range(4)]
    return build_step_inputs(chunks, TABLES, sampling, BLOCK_SIZE, torch.device(device), with_sampling=with_sampling,
                             paged_kernel=paged_kernel)


def test_decodes_come_first_and_every_field_lines_up() -> None:
    inputs = _inputs()
    meta = inputs.attn
    # Rows: decode (seq 1), decode (seq 3), then prefill seq 0 (5 rows), prefill seq 2 (3 rows).
    assert inputs.input_ids.tolist() == [10, 30, 0, 1, 2, 3, 4, 20, 21, 22]
    assert meta.positions.tolist() == [9, 2, 0, 1, 2, 3, 4, 4, 5, 6]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [13, 18, 28, 29, 30, 31, 8, 4, 5, 6]
    assert meta.num_decodes == 2
    assert meta.decode_block_tables.tolist() == [[0, 5, 3], [4, 0, 0]]  # padded with block 0
    assert meta.decode_mask.shape == (2, 1, 1, 12)
    assert meta.decode_mask[:, 0, 0].sum(-1).tolist() == [10, 3]  # context lengths
    fresh, continued = meta.prefills
    assert (fresh.start, fresh.end, fresh.block_table, fresh.mask) == (2, 7, None, None)
    assert (continued.start, continued.end, continued.context_len) == (7, 10, 7)
    assert continued.block_table.tolist() == [6, 1]
    assert continued.mask.tolist() == [[j <= i for j in range(7)] for i in (4, 5, 6)]
    # Sampled chunks in plan order (seq 0, 1, 3): their last rows, and their parameters.
    assert inputs.sample_rows.tolist() == [6, 0, 1]
    s = inputs.sampling
    assert s.temperature.tolist() == [0.0, 0.5, 1.5] and s.top_k.tolist() == [0, 1, 3]
    torch.testing.assert_close(s.top_p, torch.tensor([1.0, 0.9, 0.7]))
    assert s.seeds.tolist() == [-1, -2, -4]  # 2**64 - 1 - i as int64 bit patterns
    assert s.positions.tolist() == [5, 10, 3]
    assert not s.all_greedy and s.any_truncation
    assert _inputs(with_sampling=False).sampling is None


def _count_device_copies(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of every ``Tensor.to`` that changes device from now on (a list the test reads)."""
    copies: list[tuple[int, ...]] = []
    original = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.device != self.device:
            copies.append(tuple(self.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    return copies


def test_one_host_to_device_copy_per_step(monkeypatch) -> None:
    """Every int of a step reaches the device in one ``to()`` (fault 5 of the GPU issue)."""
    copies = _count_device_copies(monkeypatch)
    inputs = _inputs("meta")
    assert len(copies) == 1, copies
    assert inputs.input_ids.device.type == "meta" and inputs.attn.decode_mask.device.type == "meta"


def test_with_the_paged_kernel_short_chunks_join_the_decodes() -> None:
    inputs = _inputs(paged_kernel=True)
    meta = inputs.attn
    # Every chunk has at most 16 tokens: all in the paged group, in plan order, no prefill, no mask.
    assert inputs.input_ids.tolist() == [0, 1, 2, 3, 4, 10, 20, 21, 22, 30]
    assert meta.num_decodes == 10 and meta.prefills == () and meta.decode_mask is None
    assert meta.decode_query_start_loc.tolist() == [0, 5, 6, 9, 10]
    assert meta.decode_context_lens.tolist() == [5, 10, 7, 3]
    assert meta.decode_block_tables.tolist() == [[7, 2, 0], [0, 5, 3], [6, 1, 0], [4, 0, 0]]
    assert inputs.sample_rows.tolist() == [4, 5, 9]


# (D, paged_kernel): 8 takes the SDPA path; 64 with the kernel takes the compiled paged attention.
PATHS = [(8, False), (64, False), pytest.param(64, True, marks=pytest.mark.skipif(
    not cpu_kernels_available(), reason="the compiled CPU kernels are not built on this machine"))]


@pytest.mark.parametrize(("D", "paged_kernel"), PATHS)
def test_mixed_batch_equals_causal_attention_over_each_history(D: int, paged_kernel: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = _inputs(paged_kernel=paged_kernel)
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
    q_rows = [torch.randn(n, HEADS, D, generator=generator) for n in QUERY_LENS]  # plan order
    order = [0, 1, 2, 3] if paged_kernel else [1, 3, 0, 2]  # the flat batch's order: decodes first
    q = torch.cat([q_rows[i] for i in order])  # (T, H, D)
    k_new = torch.cat([histories[i][0][STARTS[i]:] for i in order])  # (T, KVH, D)
    v_new = torch.cat([histories[i][1][STARTS[i]:] for i in order])
    write_kv_cache(k_new, v_new, k_cache, v_cache, inputs.attn.slot_mapping)
    out = PagedAttention(HEADS, KV_HEADS, D, scale=D**-0.5)(q, k_new, v_new, k_cache, v_cache, inputs.attn)

    expected = []
    for i in order:
        (k_all, v_all), start, qlen = histories[i], STARTS[i], QUERY_LENS[i]
        qs = q_rows[i].transpose(0, 1)  # (H, Q, D)
        ks = k_all.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # (H, L, D)
        vs = v_all.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        mask = torch.arange(start + qlen)[None, :] <= torch.arange(start, start + qlen)[:, None]  # (Q, L)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)  # (H, Q, D)
        expected.append(o.transpose(0, 1).reshape(qlen, HEADS * D))
    torch.testing.assert_close(out, torch.cat(expected))
    assert not torch.isnan(out).any()


@pytest.mark.parametrize(("D", "paged_kernel"), PATHS)
def test_a_pure_decode_step(D: int, paged_kernel: bool) -> None:
    chunks = [ScheduledChunk(0, (1,), 6), ScheduledChunk(1, (2,), 0)]
    inputs = build_step_inputs(chunks, [[3, 1], [0]], [SamplingParams(temperature=0)] * 2, BLOCK_SIZE,
                               torch.device("cpu"), paged_kernel=paged_kernel)
    assert inputs.attn.prefills == () and inputs.sampling.all_greedy
    k_cache = torch.randn(4, BLOCK_SIZE, KV_HEADS, D)
    v_cache = torch.randn(4, BLOCK_SIZE, KV_HEADS, D)
    q, k, v = torch.randn(2, HEADS, D), torch.randn(2, KV_HEADS, D), torch.randn(2, KV_HEADS, D)
    write_kv_cache(k, v, k_cache, v_cache, inputs.attn.slot_mapping)
    out = PagedAttention(HEADS, KV_HEADS, D, scale=D**-0.5)(q, k, v, k_cache, v_cache, inputs.attn)
    # Sequence 0 attends positions 0..6 in blocks 3, 1; sequence 1 only its own new key.
    keys0 = k_cache[[3, 1]].reshape(-1, KV_HEADS, D)[:7].repeat_interleave(2, 1).transpose(0, 1)  # (H, 7, D)
    vals0 = v_cache[[3, 1]].reshape(-1, KV_HEADS, D)[:7].repeat_interleave(2, 1).transpose(0, 1)
    ref0 = F.scaled_dot_product_attention(q[0][:, None], keys0, vals0)[:, 0]  # (H, D)
    torch.testing.assert_close(out[0].view(HEADS, D), ref0)
    torch.testing.assert_close(out[1].view(HEADS, D), v[1].repeat_interleave(2, 0))  # softmax over one key


@pytest.mark.parametrize("paged_kernel", [False, True])
def test_a_step_of_one_token_chunks_lines_up_in_plan_order(paged_kernel: bool, monkeypatch) -> None:
    """The decode step's own path (worker/step_inputs.py's ``_decode_step_inputs``): rows in plan order, a
    chunk that does not sample, dynamic-RoPE lengths, and still one host-to-device copy."""
    chunks = [ScheduledChunk(0, (11,), 9), ScheduledChunk(1, (12,), 2, sample=False), ScheduledChunk(2, (13,), 4)]
    sampling = [SamplingParams(temperature=0.5 * i, top_k=i, seed=i) for i in range(3)]

    def build(device: str):
        return build_step_inputs(chunks, [[0, 5, 3], [4], [6, 1]], sampling, BLOCK_SIZE, torch.device(device),
                                 paged_kernel=paged_kernel, num_prompt_tokens=[4, 8, 2])

    inputs = build("cpu")
    meta = inputs.attn
    assert inputs.input_ids.tolist() == [11, 12, 13] and meta.positions.tolist() == [9, 2, 4]
    assert meta.slot_mapping.tolist() == [13, 18, 4]  # block_table[pos // 4] * 4 + pos % 4
    assert meta.num_decodes == 3 and meta.prefills == ()
    assert meta.decode_block_tables.tolist() == [[0, 5, 3], [4, 0, 0], [6, 1, 0]]
    assert meta.decode_context_lens.tolist() == [10, 3, 5]
    if paged_kernel:
        assert meta.decode_query_start_loc.tolist() == [0, 1, 2, 3] and meta.decode_mask is None
    else:
        assert meta.decode_query_start_loc is None and meta.decode_mask[:, 0, 0].sum(-1).tolist() == [10, 3, 5]
    assert meta.rope_seq_lens.tolist() == [10, 8, 5]  # max(prompt length, position + 1)
    assert inputs.sample_rows.tolist() == [0, 2] and inputs.chunk_last_rows == (0, 1, 2)
    s = inputs.sampling
    assert s.temperature.tolist() == [0.0, 1.0] and s.top_k.tolist() == [0, 2] and s.positions.tolist() == [10, 5]
    assert s.seeds.tolist() == [0, 2] and s.sampled_rows.tolist() == [1] and not s.all_greedy
    copies = _count_device_copies(monkeypatch)
    assert build("meta").input_ids.device.type == "meta" and len(copies) == 1, copies
