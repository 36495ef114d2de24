"""The load gauges and the counters the scheduler keeps cumulatively, brought to Prometheus. No torch."""

from __future__ import annotations

from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler


class GaugeUpdater:
    """Sets the load gauges and adds what the scheduler's cumulative counters gained since the last call
    (Prometheus counters only grow by increments)."""

    __slots__ = ("scheduler", "metrics", "prefix_cache_counted", "spec_counted")

    def __init__(self, scheduler: Scheduler, metrics: Metrics) -> None:
        self.scheduler, self.metrics = scheduler, metrics
        self.prefix_cache_counted = (0, 0)  # scheduler's queries and hits already added to the metrics
        self.spec_counted = scheduler.spec.snapshot()  # speculative decoding counters already added

    def update(self) -> None:
        """Called after every step and every abort."""
        scheduler, metrics = self.scheduler, self.metrics
        metrics.set_load(len(scheduler.running), len(scheduler.waiting), scheduler.allocator.num_free_blocks)
        queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
        metrics.prefix_cache_queries.inc(queries - self.prefix_cache_counted[0])
        metrics.prefix_cache_hits.inc(hits - self.prefix_cache_counted[1])
        self.prefix_cache_counted = (queries, hits)
        metrics.kv_offload.update(scheduler.kv_cache)
        if scheduler.spec.num_drafts != self.spec_counted.num_drafts:
            metrics.add_spec_decode(scheduler.spec, self.spec_counted)
            self.spec_counted = scheduler.spec.snapshot()
