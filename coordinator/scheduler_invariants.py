"""The scheduler's block bookkeeping checks (tests run them after every step). No torch.

Every block is free or held, never both; its ref count equals the running sequences
that list it; a shared block is cached; a cached block in a block table is full and
computed; and a plan never writes a cached or shared block.
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.block_allocator import BlockAllocator, num_blocks_for
from coordinator.sequence import Sequence, SequenceStatus
from tpserve.step import ScheduledChunk


def cached_blocks_written(scheduled: Iterable[ScheduledChunk], running: list[Sequence],
                          allocator: BlockAllocator) -> list[int]:
    """Blocks the chunks of a plan write that are cached or shared (always empty unless there is a bug)."""
    tables = {seq.seq_id: seq.block_ids for seq in running}
    block_size = allocator.block_size
    bad = []
    for chunk in scheduled:
        table = tables[chunk.seq_id]
        first = chunk.start_position // block_size
        last = (chunk.start_position + chunk.num_tokens + chunk.num_draft_tokens - 1) // block_size
        bad += [b for b in table[first:last + 1] if allocator.is_cached(b) or allocator.ref_count(b) != 1]
    return bad


def check_invariants(running: list[Sequence], waiting: Iterable[Sequence], allocator: BlockAllocator,
                     bad_writes: list[int]) -> None:
    """Asserts the block pool's bookkeeping against the live sequences (module docstring).

    Args:
        running, waiting: the scheduler's queues.
        allocator: the block pool.
        bad_writes: :func:`cached_blocks_written` of the last plan (empty when not recorded).

    Raises:
        AssertionError: a leaked, double-held, miscounted or overwritten block, or a
            sequence in the wrong queue.
    """
    block_size = allocator.block_size
    assert all(seq.status is SequenceStatus.RUNNING for seq in running)
    assert all(seq.status is SequenceStatus.WAITING and not seq.block_ids for seq in waiting)
    for seq in running:
        assert len(seq.block_ids) >= num_blocks_for(seq.num_computed_tokens, block_size)
        for index, block_id in enumerate(seq.block_ids):
            if allocator.is_cached(block_id):
                assert (index + 1) * block_size <= seq.num_computed_tokens, \
                    f"seq {seq.seq_id} holds cached block {block_id} at index {index} before computing it"
    assert not bad_writes, f"the last plan writes cached or shared blocks {bad_writes}"
    allocator.check_invariants(seq.block_ids for seq in running)
