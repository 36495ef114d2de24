"""The coordinator's per-token fast paths give exactly what the general paths give (the
per-token cost: docs/design/request-path.md): the plan's chunks as ``plan_to_pb`` now sends them (leading decodes as
columns, the rest as messages), and the detokenizer's
memoized two-token decode.

The plan's reference is the protobuf message built field by field from every attribute of
every chunk; the decode's reference is the ``tokenizers`` library's own decode.
"""

from __future__ import annotations

import pytest

from coordinator import tokenizer as tokenizer_module
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from tpserve.step_pb import plan_from_pb, plan_to_pb
from tpserve.v1 import worker_pb2 as pb

CHUNKS = (
    ScheduledChunk(0, (7,), 12),  # a decode: seq id 0 and token 7, both proto3 defaults when zero or small
    ScheduledChunk(3, (-1,), 40, (21,)),  # a decode whose token is the step before's (async), a new block
    ScheduledChunk(4, (0,), 41),
    ScheduledChunk(5, (1, 2, 3, 300), 0, (4, 9), sample=False),  # a prefill chunk that does not sample
    ScheduledChunk(6, (1, 2, 3), 17, (11,)),  # the prompt's last chunk, a new block
    ScheduledChunk(9, (5,), 80),  # a decode after a prefill chunk: a chunk message, not a column
    ScheduledChunk(2**40, (99, 5, 6), 2**20, (), num_spec_tokens=2),  # proposals to verify
    ScheduledChunk(8, (42,), 70, (12, 13), num_draft_tokens=3),  # draft-model proposals
)
NUM_LEADING_DECODES = 3


def _chunk_pb(c: ScheduledChunk) -> pb.ScheduledChunk:
    return pb.ScheduledChunk(seq_id=c.seq_id, token_ids=c.token_ids, start_position=c.start_position,
                             new_block_ids=c.new_block_ids, sample=c.sample, num_spec_tokens=c.num_spec_tokens,
                             num_draft_tokens=c.num_draft_tokens)


def test_plan_to_pb_equals_the_message_built_field_by_field_and_round_trips() -> None:
    plan = StepPlan(4, (NewSequence(6, SamplingParams(temperature=0.5, seed=3), 3),), CHUNKS, (1, 2), ((5, 1),))
    head, rest = CHUNKS[:NUM_LEADING_DECODES], CHUNKS[NUM_LEADING_DECODES:]
    msg = plan_to_pb(plan)
    assert list(msg.decode_seq_ids) == [0, 3, 4]
    assert list(msg.decode_token_ids) == [7, -1, 0]
    assert list(msg.decode_start_positions) == [12, 40, 41]
    assert (list(msg.decode_grow_rows), list(msg.decode_grow_block_ids)) == ([1], [21])
    assert list(msg.scheduled) == [_chunk_pb(c) for c in rest]
    assert plan_from_pb(pb.StepPlan.FromString(msg.SerializeToString())) == plan
    # A plan of plain decodes alone, and one whose first chunk is a prefill (no columns).
    for chunks in (head, rest):
        plan = StepPlan(5, scheduled=chunks)
        assert plan_from_pb(pb.StepPlan.FromString(plan_to_pb(plan).SerializeToString())) == plan
    assert not plan_to_pb(StepPlan(6, scheduled=rest)).decode_seq_ids


def test_the_chunk_messages_alone_still_decode() -> None:
    """A plan sent without columns (every chunk a message) reads back the same."""
    msg = pb.StepPlan(step_id=7, scheduled=[_chunk_pb(c) for c in CHUNKS])
    assert plan_from_pb(msg).scheduled == CHUNKS


@pytest.mark.parametrize("columns, match", [
    (dict(decode_seq_ids=[1, 2], decode_token_ids=[5], decode_start_positions=[3, 4]), "2 sequences, 1 tokens"),
    (dict(decode_seq_ids=[1], decode_token_ids=[5], decode_start_positions=[3, 4]), "2 positions"),
    (dict(decode_seq_ids=[1], decode_token_ids=[5], decode_start_positions=[3], decode_grow_rows=[1],
          decode_grow_block_ids=[8]), r"new blocks \[1\] -> \[8\]"),
    (dict(decode_seq_ids=[1], decode_token_ids=[5], decode_start_positions=[3], decode_grow_rows=[0]), "new blocks"),
])
def test_malformed_decode_columns_are_refused(columns, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan_from_pb(pb.StepPlan(step_id=9, **columns))


def test_decode_pair_equals_the_tokenizers_decode_and_starts_over_when_full(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer_module, "PAIR_MEMO_SIZE", 50)
    tokenizer._pair_texts.clear()
    backend = tokenizer._backend
    special = sorted(tokenizer.special_token_ids)
    ids = [*range(0, tokenizer.vocab_size, 7), *special]
    for first, second in zip(ids, ids[3:] + ids[:3]):
        expected = backend.decode([first, second], skip_special_tokens=True)
        assert tokenizer.decode_pair(first, second) == expected
        assert tokenizer.decode_pair(first, second) == expected  # from the memo
        assert len(tokenizer._pair_texts) <= 50
