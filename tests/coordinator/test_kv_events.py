"""Prefix-cache events for a gateway: what the allocator announces, and to whom (no torch)."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import pytest

from coordinator import kv_events
from coordinator.block_allocator import BlockAllocator
from coordinator.errors import ResourceExhaustedError
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
    batch = log.read(first)
    stored, *removed = batch.events
    assert list(stored.stored.blocks[0].token_ids) == [5, 6] and stored.stored.blocks[0].block_size == 2
    assert stored.stored.parent_block_hash == 0 and stored.stored.cache_salt == "ab"
    assert stored.stored.blocks[0].block_hash == block_hash_int64(b"\x01" * 32) == 0x0101010101010101
    assert [e.removed.block_hashes[0] for e in removed] == [0x0101010101010101, 0]
    assert [e.event_id for e in batch.events] == [1, 2, 3] and batch.sequence_number == 1
    assert log.read(first) is None  # read everything
    assert len(log.read(second).events) == 3
    log.unsubscribe(second)
    log.removed(b"\x02" * 32)
    assert log.read(first).sequence_number == 2  # the one left reads on
    assert block_hash_int64(b"\xff" * 32) == -1


def test_a_late_subscriber_starts_at_its_own_batch_one() -> None:
    log = KvEventLog(16)
    early = log.subscribe()
    log.removed(b"\x01" * 32)
    late = log.subscribe()  # the event before it is not its to read
    log.removed(b"\x02" * 32)
    assert [b.sequence_number for b in (log.read(early), log.read(early))] == [1, 2]
    batch = log.read(late)
    assert batch.sequence_number == 1 and batch.events[0].removed.block_hashes == [0x0202020202020202]


def test_a_lagging_subscriber_sees_the_sequence_number_jump_over_what_was_dropped(monkeypatch) -> None:
    """The shared ring keeps MAX_BUFFERED_EVENTS; a reader behind it skips to the oldest
    batch kept, and its sequence numbers say how many batches it lost."""
    monkeypatch.setattr(kv_events, "MAX_BUFFERED_EVENTS", 3)
    log = KvEventLog(16)
    slow, fast = log.subscribe(), log.subscribe()
    for i in range(5):  # 5 batches of one event, read at once by the fast reader
        log.removed(bytes([i]) * 32)
        assert log.read(fast).sequence_number == i + 1
    assert log.num_buffered_events == 3
    batches = [log.read(slow), log.read(slow), log.read(slow)]
    assert [b.sequence_number for b in batches] == [3, 4, 5]  # 1 and 2 were dropped: it starts at 3
    assert [b.events[0].removed.block_hashes[0] for b in batches] == [block_hash_int64(bytes([i]) * 32)
                                                                       for i in (2, 3, 4)]
    assert log.read(slow) is None


def test_subscribers_past_the_cap_are_refused_with_resource_exhausted() -> None:
    log = KvEventLog(16, max_subscribers=2)
    first, _ = log.subscribe(), log.subscribe()
    with pytest.raises(ResourceExhaustedError, match="--max-kv-event-subscribers 2"):
        log.subscribe()
    log.unsubscribe(first)
    log.subscribe()  # a place came free


def test_a_reader_waiting_wakes_on_the_first_event_of_a_step() -> None:
    async def scenario() -> list[int]:
        log = KvEventLog(16)
        subscriber = log.subscribe()
        reader = asyncio.ensure_future(log.next_batch(subscriber))
        await asyncio.sleep(0)
        assert not reader.done()
        log.removed(b"\x01" * 32)  # one step's events, recorded without a yield in between
        log.removed(b"\x02" * 32)
        batch = await asyncio.wait_for(reader, 1)
        return [e.event_id for e in batch.events]

    assert asyncio.run(scenario()) == [1, 2]


def _publish_seconds(num_subscribers: int, num_events: int) -> float:
    """Seconds the allocator's side takes to record ``num_events`` stored events with
    ``num_subscribers`` subscribed that never read (best of 3)."""
    best = float("inf")
    for _ in range(3):
        log = KvEventLog(16, max_subscribers=num_subscribers)
        for _ in range(num_subscribers):
            log.subscribe()
        tokens = list(range(16))
        start = time.perf_counter()
        for i in range(num_events):
            log.stored(i.to_bytes(32, "big"), tokens, None)
        best = min(best, time.perf_counter() - start)
    return best


def test_idle_subscribers_do_not_slow_the_engines_publish() -> None:
    """Issue 41, fault 3: each event was appended to every subscriber's list on the engine loop,
    so 1,000 subscribers that never read cost the engine 1,000 times the work."""
    one, thousand = _publish_seconds(1, 3_000), _publish_seconds(1_000, 3_000)
    assert thousand < 3 * one, f"1 subscriber: {one * 1e3:.1f} ms, 1,000: {thousand * 1e3:.1f} ms"


def test_memory_per_lagging_subscriber_is_bounded() -> None:
    """1,000 subscribers that never read, 5,000 events: the events are kept once (the shared
    ring), each subscriber holds a cursor, not its own copy."""
    tokens = list(range(16))

    def grown_bytes(num_subscribers: int) -> int:
        log = KvEventLog(16, max_subscribers=num_subscribers)
        tracemalloc.start()
        for _ in range(num_subscribers):
            log.subscribe()
        for i in range(5_000):
            log.stored(i.to_bytes(32, "big"), tokens, None)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert log.num_buffered_events <= kv_events.MAX_BUFFERED_EVENTS
        return size

    per_subscriber = (grown_bytes(1_000) - grown_bytes(1)) / 999
    assert per_subscriber < 2_048, f"{per_subscriber:.0f} bytes per lagging subscriber"
