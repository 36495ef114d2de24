"""The serving coordinator's garbage-collector thresholds (docs/design/request-path.md, "Where a streamed token's
coordinator CPU goes").

Every streamed token allocates a handful of objects the collector tracks (the step's
output, the stream message, futures, loop handles); nearly all are freed by reference
counting at once, but each allocation still counts towards the next young collection,
and every tenth of those towards a middle one, which walks everything alive since the
last full one: in a serving process, the in-flight requests, their streams and gRPC's
objects. With CPython's default first threshold (700 allocations) the coordinator
collected several times per decode step at 64-256 streams. With these thresholds its
CPU per token fell to 0.81-0.86x at 256 streams and 0.93-0.98x at 64 in interleaved runs
of benchmarks/coordinator_cpu.py (2026-12-02, load average 4-9, so only the ratios
mean much). Each collection walks the same survivors, just less often; garbage in
reference cycles (exceptions with tracebacks, cancelled tasks) waits at most that many
allocations longer, a few MB at most. A young collection in which all 50,000 objects
survive takes about 1 ms on the 2-core test host (most die at once, so it is usually far
less), below one decode step.

Set by launch/public_server.py when the engine is attached, right after the start-up heap
is frozen (``gc.freeze``). No torch.
"""

from __future__ import annotations

import gc

#: (young, middle, old) thresholds of ``gc.set_threshold``: young collections every 50,000
#: net allocations instead of 700; the other two keep CPython's defaults.
SERVING_GC_THRESHOLDS = (50_000, 10, 10)


def set_serving_gc_thresholds() -> None:
    """Sets :data:`SERVING_GC_THRESHOLDS` for this process (the coordinator's, once it serves)."""
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
