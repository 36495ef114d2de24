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

With the host tier on (``--kv-offloading-size``; coordinator/kv_host_tier.py) a block may be
cached in two tiers at once, and every stored and removed event says which: ``medium`` "GPU"
(``tier`` DEVICE: the device pool, whatever the device; vLLM's name) or "CPU" (``tier`` HOST:
the host tier), as vLLM's offloading connector publishes them. Host-tier stores carry no token
ids (the device event for the same hash did). Without the tier the events are as before (no
medium: the device).

Data flow (docs/design/request-path.md, "KV events: one shared ring"; per-subscriber work on the engine loop let
1,000 subscribers
that never read cut throughput 7x and grow the coordinator by 680 MB):

- the engine (the allocator, during a step) appends each event once to one *open batch*,
  whatever the number of subscribers; the first event of a batch wakes the waiting readers
  (one ``asyncio.Event``), and nothing else happens on the engine's side;
- a reader, in its own RPC task, seals the open batch into one shared *ring* of batches
  (numbered 1, 2, ...; at most :data:`MAX_BUFFERED_EVENTS` events kept, oldest batches
  dropped first) and reads the ring from its own cursor. A subscriber holds a cursor, not a
  copy: its memory does not grow when it lags;
- a reader whose next batch already left the ring skips to the oldest kept one, and the
  ``sequence_number`` it sees jumps by the number of batches it missed (the way vLLM's KV
  event stream tells a subscriber it lost messages). A subscriber's first batch is number 1.

A step's events leave together, before the engine loop streams that step's outputs (vLLM
publishes its KV events once per step). Events are recorded only while someone
subscribes (nothing accumulates otherwise). At most ``max_subscribers`` subscribe at once;
one more gets RESOURCE_EXHAUSTED. No torch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

from smg_grpc_proto.generated import common_pb2

from coordinator.errors import ResourceExhaustedError

#: Most events the ring keeps for readers that lag (about 30 MB of block-stored events at
#: 16 tokens a block), shared by every subscriber; older batches are dropped first.
MAX_BUFFERED_EVENTS = 65_536
#: Most events of one batch: a batch nobody reads is sealed by the engine at this size, so
#: that the ring's bound holds even while every subscriber is stuck on a full connection.
MAX_BATCH_EVENTS = 4_096
#: ``medium`` -> the protocol's tier enum.
_TIERS = {"GPU": common_pb2.KV_CACHE_TIER_DEVICE, "CPU": common_pb2.KV_CACHE_TIER_HOST}
#: Default of ``--max-kv-event-subscribers``: a gateway replica subscribes once per worker,
#: so a fleet needs a handful; each more costs a wake-up per batch.
DEFAULT_MAX_SUBSCRIBERS = 16


def block_hash_int64(block_hash: bytes) -> int:
    """A block digest as the protocol's signed 64-bit ``block_hash`` (its first 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


class KvEventLog:
    """Records prefix-cache events once, for every subscriber (the allocator's ``listener``).

    Args:
        block_size: tokens per block.
        max_subscribers: most subscribers at once (``--max-kv-event-subscribers``).
    """

    def __init__(self, block_size: int, max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS) -> None:
        self.block_size = block_size
        self.max_subscribers = max_subscribers
        self._open: list[common_pb2.KvCacheEvent] = []  # the batch being recorded
        self._ring: deque[tuple[int, float, list[common_pb2.KvCacheEvent]]] = deque()  # (number, time, events)
        self._num_buffered = 0  # events in the ring
        self._next_batch = 1  # number of the next sealed batch
        self._cursors: dict[int, int] = {}  # subscriber -> number of the next batch it reads
        self._first_batch: dict[int, int] = {}  # subscriber -> the first batch number it could read
        self._recorded = asyncio.Event()  # set while the open batch has events
        self._next_subscriber = 0
        self._next_event_id = 1
        #: The device pool's ``medium`` on its events: None (unsaid) unless a host tier is on.
        self.device_medium: str | None = None

    @property
    def num_subscribers(self) -> int:
        """Subscribers now."""
        return len(self._cursors)

    @property
    def num_buffered_events(self) -> int:
        """Events held for the subscribers (sealed and open), at most about :data:`MAX_BUFFERED_EVENTS`."""
        return self._num_buffered + len(self._open)

    # -- the allocator's side (the engine loop: constant work per event) ----------------

    def stored(self, block_hash: bytes, token_ids: Sequence[int], parent_hash: bytes | None,
               namespace: bytes = b"", medium: str | None = None) -> None:
        """Block ``block_hash`` (its ``block_size`` tokens ``token_ids``) entered the cache's tier ``medium``
        ("GPU", "CPU"; None: the device pool)."""
        if not self._cursors:
            return
        stored = common_pb2.KvBlocksStored(blocks=[common_pb2.KvBlock(
            block_hash=block_hash_int64(block_hash), token_ids=list(token_ids), block_size=self.block_size)])
        if parent_hash is not None:
            stored.parent_block_hash = block_hash_int64(parent_hash)
        if namespace:
            stored.cache_salt = namespace.hex()
        medium = medium or self.device_medium
        if medium:
            stored.medium, stored.tier = medium, _TIERS[medium]
        self._record(common_pb2.KvCacheEvent(stored=stored))

    def removed(self, block_hash: bytes, medium: str | None = None) -> None:
        """Block ``block_hash`` left the cache's tier ``medium`` (evicted or flushed; None: the device pool)."""
        if self._cursors:
            removed = common_pb2.KvBlocksRemoved(block_hashes=[block_hash_int64(block_hash)])
            medium = medium or self.device_medium
            if medium:
                removed.medium, removed.tier = medium, _TIERS[medium]
            self._record(common_pb2.KvCacheEvent(removed=removed))

    def cleared(self) -> None:
        """Every cached block is gone (a new pool)."""
        if self._cursors:
            self._record(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))

    def _record(self, event: common_pb2.KvCacheEvent) -> None:
        event.event_id = self._next_event_id
        self._next_event_id += 1
        self._open.append(event)
        if len(self._open) == 1:
            self._recorded.set()  # once per batch: wakes the readers waiting now
        elif len(self._open) >= MAX_BATCH_EVENTS:
            self._seal()

    def _seal(self) -> None:
        """Moves the open batch into the ring, dropping the oldest batches beyond the bound."""
        self._ring.append((self._next_batch, time.time(), self._open))
        self._next_batch += 1
        self._num_buffered += len(self._open)
        self._open = []
        self._recorded.clear()
        while self._num_buffered > MAX_BUFFERED_EVENTS and len(self._ring) > 1:
            self._num_buffered -= len(self._ring.popleft()[2])

    # -- the subscribers' side (each in its own RPC task) ------------------------------------

    def subscribe(self) -> int:
        """A new subscriber, from now on; returns its id for :meth:`read` and :meth:`unsubscribe`.

        Raises:
            ResourceExhaustedError: ``max_subscribers`` subscribe already.
        """
        if len(self._cursors) >= self.max_subscribers:
            raise ResourceExhaustedError(
                f"SubscribeKvEvents: {len(self._cursors)} subscribers already, the most this server takes "
                f"(--max-kv-event-subscribers {self.max_subscribers}); retry when one unsubscribes")
        if self._open:
            self._seal()  # events recorded before this subscriber are not its to read
        subscriber = self._next_subscriber
        self._next_subscriber += 1
        self._cursors[subscriber] = self._first_batch[subscriber] = self._next_batch
        return subscriber

    def unsubscribe(self, subscriber: int) -> None:
        """Forgets ``subscriber`` (its stream ended); unknown ids are ignored."""
        self._cursors.pop(subscriber, None)
        self._first_batch.pop(subscriber, None)
        if not self._cursors:  # nobody left to read them
            self._ring.clear()
            self._open = []
            self._num_buffered = 0
            self._recorded.clear()

    def read(self, subscriber: int) -> common_pb2.KvEventBatch | None:
        """The subscriber's next batch, or None when it has read everything recorded so far.

        Its ``sequence_number`` counts the subscriber's batches from 1; a jump means the
        subscriber lagged and the batches in between were dropped.
        """
        cursor = self._cursors[subscriber]
        if cursor >= self._next_batch:  # read up to the ring's end
            if not self._open:
                return None
            self._seal()
        oldest = self._ring[0][0]
        number, timestamp, events = self._ring[max(cursor, oldest) - oldest]
        self._cursors[subscriber] = number + 1
        return common_pb2.KvEventBatch(sequence_number=number - self._first_batch[subscriber] + 1,
                                       timestamp=timestamp, events=events)

    async def next_batch(self, subscriber: int) -> common_pb2.KvEventBatch:
        """Waits for, then returns, the subscriber's next batch (:meth:`read`)."""
        while (batch := self.read(subscriber)) is None:
            await self._recorded.wait()
        return batch
