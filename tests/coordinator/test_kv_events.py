"""Prefix-cache events for a gateway: what the allocator announces, and to whom (no torch)."""

from __future__ import annotations

from coordinator import kv_events
from coordinator.block_allocator import BlockAllocator
from coordinator.kv_events import KvEventLog, block_hash_int64


def test_stored_evicted_and_flushed_blocks_reach_every_subscriber() -> None:
    allocator = BlockAllocator(2, block_size=2)
    log = allocator.listener = KvEventLog(2)
    allocator.cache(allocator.allocate(1)[0], b"\x00" * 32)  # nobody subscribes: nothing is kept
    first, second = log.subscribe(), log.subscribe()
    (a,) = allocator.allocate(1)
    allocator.cache(a, b"\x01" * 32, (5, 6), parent_hash=b"\x00" * 32, namespace=b"\xab")
    allocator.free([a])
    allocator.free([0])
    allocator.allocate(2)  # evicts both cached blocks, least recently freed first
    batch = log.drain(first, 1)
    stored, *removed = batch.events
    assert list(stored.stored.blocks[0].token_ids) == [5, 6] and stored.stored.blocks[0].block_size == 2
    assert stored.stored.parent_block_hash == 0 and stored.stored.cache_salt == "ab"
    assert stored.stored.blocks[0].block_hash == block_hash_int64(b"\x01" * 32) == 0x0101010101010101
    assert [e.removed.block_hashes[0] for e in removed] == [0x0101010101010101, 0]
    assert [e.event_id for e in batch.events] == [1, 2, 3] and batch.sequence_number == 1
    assert log.drain(first, 2) is None  # drained
    assert len(log.drain(second, 1).events) == 3
    log.unsubscribe(second)
    allocator.free([0, 1])
    assert log.drain(second, 2) is None


def test_a_subscriber_that_falls_behind_is_told_to_start_over(monkeypatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_PENDING_EVENTS", 3)
    log = KvEventLog(16)
    subscriber = log.subscribe()
    for i in range(4):
        log.removed(bytes([i]) * 32)
    (event,) = log.drain(subscriber, 1).events
    assert event.HasField("cleared")
    assert block_hash_int64(b"\xff" * 32) == -1
