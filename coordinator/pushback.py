"""Server pushback (gRFC A6): how long a client refused with RESOURCE_EXHAUSTED should wait.

The coordinator answers a full queue's RESOURCE_EXHAUSTED with ``grpc-retry-pushback-ms``
trailing metadata (coordinator/errors.py); a client channel with gRPC's retry policy
(tpserve/service_config.py) waits exactly that long before its next attempt, instead of its
own random backoff. A RESOURCE_EXHAUSTED that no retry can cure (a request larger than the KV
cache, a full set of event subscribers) carries ``-1``: gRPC does not retry it at all.

The value for a full queue is the queueing delay now: how long the oldest waiting sequence has
waited (its ``arrival_s``, on the scheduler's monotonic clock), the sojourn time CoDel-style
queue managers steer by. A request arriving now would wait about that long, and the queue has
turned over about once by then; clients refused together come back spread by their own arrival
times. Bounded to [:data:`MIN_PUSHBACK_MS`, :data:`MAX_PUSHBACK_MS`]: a queue whose places are all
held (no sequence waiting yet) or just filled gets the minimum, and no client is told to go away
for longer than a deadline would usually allow. No torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

#: The trailing metadata key gRPC's retry policy reads (gRFC A6).
PUSHBACK_KEY = "grpc-retry-pushback-ms"
#: The shortest pushback, in milliseconds: a queue just filled frees a place within a step or two.
MIN_PUSHBACK_MS = 100
#: The longest pushback, in milliseconds.
MAX_PUSHBACK_MS = 10_000
#: The pushback that tells gRPC not to retry (any negative value does).
NO_RETRY_PUSHBACK_MS = -1


class _Waiting(Protocol):
    arrival_s: float | None


def queue_full_pushback_ms(waiting: Iterable[_Waiting], now: float | None = None) -> int:
    """The pushback, in milliseconds, for a request refused by a full queue of ``waiting`` sequences.

    Args:
        waiting: the scheduler's waiting sequences (their ``arrival_s``: monotonic seconds, None
            for one not queued yet).
        now: monotonic seconds (default ``time.monotonic()``).
    """
    now = time.monotonic() if now is None else now
    oldest = min((seq.arrival_s for seq in waiting if seq.arrival_s is not None), default=now)
    return int(min(max((now - oldest) * 1000.0, MIN_PUSHBACK_MS), MAX_PUSHBACK_MS))
