"""The serving coordinator's garbage-collector thresholds (coordinator/gc_policy.py; docs/design/request-path.md)."""

from __future__ import annotations

import gc

from coordinator.gc_policy import SERVING_GC_THRESHOLDS, set_serving_gc_thresholds


def test_serving_thresholds_collect_the_young_generation_every_50000_allocations() -> None:
    before = gc.get_threshold()
    assert before[0] < SERVING_GC_THRESHOLDS[0]  # CPython's default (700, or 2000 in 3.13+) in a test process
    try:
        set_serving_gc_thresholds()
        assert gc.get_threshold() == (50_000, 10, 10)
        # Young objects pile up without a collection until the threshold: count them after a burst.
        gc.collect()
        garbage = [[i] for i in range(10_000)]
        assert gc.get_count()[0] >= 10_000
        del garbage
    finally:
        gc.set_threshold(*before)
