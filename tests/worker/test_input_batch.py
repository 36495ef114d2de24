"""The persistent batch (worker/input_batch.py) and the per-backend metadata builders (worker/attention_builders.py).

The batch is checked against the plain reference it replaces: per sequence, a Python
list of block ids, edited by the plan's deltas; the step inputs built from its tensor
against those built from the lists, field by field, for every backend's builder.
"""

from __future__ import annotations

import random

import pytest
import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.attention_builders import (
    PagedKernelMetadataBuilder,
    SdpaMetadataBuilder,
    TritonMetadataBuilder,
    select_metadata_builder,
)
from worker.input_batch import InputBatch
from worker.step_inputs import block_table_tensor, build_step_inputs


def test_tables_follow_the_plan_deltas_like_lists() -> None:
    rng = random.Random(7)
    batch, reference = InputBatch(max_blocks_per_seq=2, capacity=2), {}  # small: rows and columns must grow
    for _ in range(400):
        op = rng.random()
        if op < 0.25 or not reference:
            seq_id = rng.randrange(40)
            batch.add(seq_id)  # a known id is reset (a preempted sequence comes back)
            reference[seq_id] = []
        elif op < 0.6:
            seq_id = rng.choice(list(reference))
            blocks = [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 4))]
            batch.append_blocks(seq_id, blocks)
            reference[seq_id].extend(blocks)
        elif op < 0.75:
            seq_id = rng.choice(list(reference))
            keep = rng.randrange(0, 6)
            batch.trim(seq_id, keep)
            del reference[seq_id][keep:]
        else:
            seq_id = rng.choice(list(reference))
            batch.remove(seq_id)
            del reference[seq_id]
        batch.trim(10_000, 0)  # unknown ids are ignored
        batch.remove(10_000)
        assert len(batch) == len(reference)
        if reference:
            ids = rng.sample(list(reference), rng.randrange(1, len(reference) + 1))
            if any(reference[s] for s in ids):
                assert torch.equal(batch.tables(ids), block_table_tensor([reference[s] for s in ids]))
    assert batch.block_tables.shape[0] > 2 and batch.block_tables.shape[1] > 2  # both grew


# A mixed step: a fresh prefill, a decode, a continued prompt chunk, a decode, a chunk with proposals.
CHUNKS = [ScheduledChunk(0, (1, 2, 3, 4, 5), 0), ScheduledChunk(1, (6,), 9),
          ScheduledChunk(2, (7, 8, 9), 4, sample=False), ScheduledChunk(3, (10,), 2),
          ScheduledChunk(4, (11, 12, 13), 6, num_spec_tokens=2)]
TABLES = [[7, 2], [0, 5, 3], [6, 1], [4], [8, 9, 10]]


@pytest.mark.parametrize("builder", [SdpaMetadataBuilder(), TritonMetadataBuilder(), PagedKernelMetadataBuilder()])
def test_inputs_from_the_batch_equal_those_from_lists(builder) -> None:
    batch = InputBatch(max_blocks_per_seq=1)
    for seq_id in (9, 0, 1, 2, 3, 4):  # rows not in plan order
        batch.add(seq_id)
    batch.append_blocks(9, [11, 12, 13, 14])
    batch.remove(9)  # its row is reused, and must not leak its blocks
    for chunk, table in zip(CHUNKS, TABLES):
        batch.append_blocks(chunk.seq_id, table)
    sampling = [SamplingParams(temperature=0.5 * i, seed=i) for i in range(len(CHUNKS))]
    ours = build_step_inputs(CHUNKS, batch.tables([c.seq_id for c in CHUNKS]), sampling, 4, torch.device("cpu"),
                             builder=builder, num_prompt_tokens=[5, 3, 8, 1, 2])
    lists = build_step_inputs(CHUNKS, TABLES, sampling, 4, torch.device("cpu"), builder=builder,
                              num_prompt_tokens=[5, 3, 8, 1, 2])
    assert ours.chunk_last_rows == lists.chunk_last_rows
    for name in ("input_ids", "sample_rows", "spec_rows"):
        assert torch.equal(getattr(ours, name), getattr(lists, name)), name
    for name in ("positions", "slot_mapping", "decode_block_tables", "decode_context_lens", "decode_mask",
                 "decode_query_start_loc", "rope_seq_lens"):
        a, b = getattr(ours.attn, name), getattr(lists.attn, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert ours.attn.num_decodes == lists.attn.num_decodes and ours.attn.triton_decode == lists.attn.triton_decode
    assert [(p.start, p.end, p.context_len) for p in ours.attn.prefills] == \
        [(p.start, p.end, p.context_len) for p in lists.attn.prefills]


def test_each_backend_lays_out_the_decode_group_its_own_way() -> None:
    sampling = [SamplingParams()] * len(CHUNKS)
    sdpa = build_step_inputs(CHUNKS, TABLES, sampling, 4, torch.device("cpu"), builder=SdpaMetadataBuilder()).attn
    triton = build_step_inputs(CHUNKS, TABLES, sampling, 4, torch.device("cpu"), builder=TritonMetadataBuilder()).attn
    paged = build_step_inputs(CHUNKS, TABLES, sampling, 4, torch.device("cpu"),
                              builder=PagedKernelMetadataBuilder()).attn
    # SDPA and Triton: the decodes and the chunk with proposals, one row each (2 + 3 rows), the prefills after.
    assert sdpa.num_decodes == triton.num_decodes == 5
    assert sdpa.decode_context_lens.tolist() == [10, 3, 7, 8, 9]  # each row's position + 1
    assert sdpa.decode_mask is not None and triton.decode_mask is None and triton.triton_decode
    # The paged kernel: every chunk of up to 16 tokens, one entry per chunk with its row offsets.
    assert paged.num_decodes == 13 and not paged.prefills
    assert paged.decode_query_start_loc.tolist() == [0, 5, 6, 9, 10, 13]
    assert paged.decode_context_lens.tolist() == [5, 10, 7, 3, 9]
    assert paged.decode_mask is None and not paged.triton_decode


def test_the_builder_is_selected_by_the_backend() -> None:
    assert isinstance(select_metadata_builder(paged_kernel=True, triton_decode=True), PagedKernelMetadataBuilder)
    assert isinstance(select_metadata_builder(triton_decode=True), TritonMetadataBuilder)
    assert isinstance(select_metadata_builder(), SdpaMetadataBuilder)
