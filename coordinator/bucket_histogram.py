"""A Prometheus histogram for a per-token hot path: observed without a lock, read at the scrape.

``prometheus_client.Histogram.observe`` takes a lock and costs about 2 us; one observation per
request per step (the inter-token latency) would add 2 us to the coordinator's work per token
at every batch size, several per cent of it (benchmarks/coordinator_cpu.py measures the rest).
Here an observation is a ``bisect`` and two additions on the event loop's thread, the only one
that observes; the scrape (the /metrics server's thread) copies the counts and exports them as
any histogram, through prometheus_client's custom-collector interface. A scrape racing an
observation may see the sum without that value, never a non-cumulative bucket. No torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BucketHistogram(Collector):
    """A histogram named ``name`` (Prometheus' ``le`` buckets at ``bounds``, seconds or any unit).

    Args:
        name: the metric's name, without ``_bucket`` / ``_count`` / ``_sum``.
        documentation: its HELP text.
        bounds: the buckets' upper bounds, increasing (``+Inf`` is added).
        registry: where it is exported.

    Raises:
        ValueError: ``bounds`` empty or not strictly increasing.
    """

    def __init__(self, name: str, documentation: str, bounds: Sequence[float], registry: CollectorRegistry) -> None:
        if not bounds or any(b >= a for a, b in zip(bounds[1:], bounds, strict=False)):
            raise ValueError(f"{name}: bucket bounds must be strictly increasing, got {list(bounds)}")
        self.name, self.documentation = name, documentation
        self._bounds = list(bounds)
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        """Counts ``value`` in the first bucket whose bound is >= it (Prometheus' ``le``)."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total_sum = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*map(floatToGoString, self._bounds), "+Inf"], counts, strict=True):
            running += count
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=total_sum)
