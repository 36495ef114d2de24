"""The load gauges and the counters the scheduler keeps cumulatively, brought to Prometheus. No torch."""

from __future__ import annotations

from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler


class GaugeUpdater:
    """Sets the load gauges and adds what the scheduler's cumulative counters gained since the last call
    (Prometheus counters only grow by increments)."""

    __slots__ = ("scheduler", "metrics", "prefix_cache_counted", "spec_counted", "state_counted")

    def __init__(self, scheduler: Scheduler, metrics: Metrics) -> None:
        self.scheduler, self.metrics = scheduler, metrics
        self.prefix_cache_counted = (0, 0)  # scheduler's queries and hits already added to the metrics
        self.spec_counted = scheduler.spec.snapshot()  # speculative decoding counters already added
        self.state_counted = (0, 0)  # hybrids: the state slots' checkpoint queries and hits already added

    def update(self, step_streamed: bool = False) -> None:
        """Called after every step (``step_streamed``: its tokens went out to their requests) and every abort.

        The speculative decoding counters are added only after a step's tokens went out: a stop string found
        in them takes back the accepted proposals past it (SpecDecodeStats.take_back), and one added before
        (an abort while the step loop awaits) would stay too high, a Prometheus counter never falling."""
        scheduler, metrics = self.scheduler, self.metrics
        metrics.set_load(len(scheduler.running), len(scheduler.waiting), scheduler.allocator.num_free_blocks)
        queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
        metrics.prefix_cache_queries.inc(queries - self.prefix_cache_counted[0])
        metrics.prefix_cache_hits.inc(hits - self.prefix_cache_counted[1])
        self.prefix_cache_counted = (queries, hits)
        slots = scheduler.state_slots
        if slots is not None and slots.num_checkpoint_queries != self.state_counted[0]:
            metrics.prefix_cache_state_queries.inc(slots.num_checkpoint_queries - self.state_counted[0])
            metrics.prefix_cache_state_hits.inc(slots.num_checkpoint_hits - self.state_counted[1])
            self.state_counted = (slots.num_checkpoint_queries, slots.num_checkpoint_hits)
        metrics.kv_offload.update(scheduler.kv_cache)
        spec, counted = scheduler.spec, self.spec_counted
        if step_streamed and (spec.num_drafts, spec.num_accepted_tokens) != (counted.num_drafts,
                                                                               counted.num_accepted_tokens):
            metrics.add_spec_decode(scheduler.spec, self.spec_counted)
            self.spec_counted = scheduler.spec.snapshot()
