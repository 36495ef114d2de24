"""The prefix cache's events (blocks stored, blocks removed, all cleared), for a gateway.

A gateway's cache-aware policy learns from these which replica holds which prompt
prefixes (the engine protocol's SubscribeKvEvents, ``smg_grpc_proto`` common.proto):

- **stored**: a full block's K/V entered the prefix cache
  (:meth:`coordinator.block_allocator.BlockAllocator.cache`), with its tokens and the hash
  of the block before it in its sequence (none for a sequence's first block);
- **removed**: a cached block was evicted or flushed; its contents are gone;
- **cleared**: the whole pool was replaced (the worker group restarted).

Block hashes are our 32-byte chained digests (:func:`coordinator.kv_cache_manager.extend_block_hashes`)
reduced to a signed 64-bit integer, big-endian, as the protocol's ``block_hash`` is: the
gateway uses them as node identities and hashes the token ids itself. A block computed
under a tenant's or a salt's namespace carries it in ``cache_salt`` (hex), so that the
gateway keeps it apart from unsalted prefixes.

Each subscriber has its own pending list, and a subscriber waiting in :meth:`KvEventLog.wait`
wakes as soon as an event is recorded: a step's events leave together, before the engine loop
streams that step's outputs (vLLM publishes its KV events once per step). Events are recorded
only while someone subscribes (nothing accumulates otherwise). No torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from smg_grpc_proto.generated import common_pb2

#: Most events kept for one subscriber between two drains; beyond it, the subscriber is
#: told everything was cleared (it then relearns from later events) rather than grow without bound.
MAX_PENDING_EVENTS = 100_000


def block_hash_int64(block_hash: bytes) -> int:
    """A block digest as the protocol's signed 64-bit ``block_hash`` (its first 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


class KvEventLog:
    """Records prefix-cache events for each subscriber (the allocator's ``listener``).

    Args:
        block_size: tokens per block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pending: dict[int, list[common_pb2.KvCacheEvent]] = {}
        self._ready: dict[int, asyncio.Event] = {}  # set while the subscriber has pending events
        self._next_subscriber = 0
        self._next_event_id = 1

    # -- the allocator's side --------------------------------------------------------

    def stored(self, block_hash: bytes, token_ids: Sequence[int], parent_hash: bytes | None,
               namespace: bytes = b"") -> None:
        """Block ``block_hash`` (its ``block_size`` tokens ``token_ids``) entered the cache."""
        if not self._pending:
            return
        stored = common_pb2.KvBlocksStored(blocks=[common_pb2.KvBlock(
            block_hash=block_hash_int64(block_hash), token_ids=list(token_ids), block_size=self.block_size)])
        if parent_hash is not None:
            stored.parent_block_hash = block_hash_int64(parent_hash)
        if namespace:
            stored.cache_salt = namespace.hex()
        self._record(common_pb2.KvCacheEvent(stored=stored))

    def removed(self, block_hash: bytes) -> None:
        """Block ``block_hash`` left the cache (evicted or flushed)."""
        if self._pending:
            self._record(common_pb2.KvCacheEvent(
                removed=common_pb2.KvBlocksRemoved(block_hashes=[block_hash_int64(block_hash)])))

    def cleared(self) -> None:
        """Every cached block is gone (a new pool)."""
        if self._pending:
            self._record(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))

    def _record(self, event: common_pb2.KvCacheEvent) -> None:
        event.event_id = self._next_event_id
        self._next_event_id += 1
        for subscriber, events in self._pending.items():
            if len(events) >= MAX_PENDING_EVENTS:
                self._pending[subscriber] = [common_pb2.KvCacheEvent(event_id=event.event_id,
                                                                     cleared=common_pb2.KvCacheCleared())]
            else:
                events.append(event)
            self._ready[subscriber].set()

    # -- the subscribers' side -------------------------------------------------------

    def subscribe(self) -> int:
        """A new subscriber, from now on; returns its id for :meth:`drain` and :meth:`unsubscribe`."""
        subscriber = self._next_subscriber
        self._next_subscriber += 1
        self._pending[subscriber] = []
        self._ready[subscriber] = asyncio.Event()
        return subscriber

    def unsubscribe(self, subscriber: int) -> None:
        self._pending.pop(subscriber, None)
        self._ready.pop(subscriber, None)

    async def wait(self, subscriber: int) -> None:
        """Returns once the subscriber has events to :meth:`drain` (at once if it has some already).
        Called on the engine's event loop, as the allocator records on it."""
        await self._ready[subscriber].wait()

    def drain(self, subscriber: int, sequence_number: int) -> common_pb2.KvEventBatch | None:
        """The subscriber's events since its last drain as batch ``sequence_number``, or None if none."""
        events = self._pending.get(subscriber)
        if not events:
            return None
        self._pending[subscriber] = []
        self._ready[subscriber].clear()
        return common_pb2.KvEventBatch(sequence_number=sequence_number, timestamp=time.time(), events=events)
