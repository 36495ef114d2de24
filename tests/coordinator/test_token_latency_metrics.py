"""vLLM's two TPOT histograms: one sample per finished request (``request_time_per_output_token``) and one per
request per step after its first token (``inter_token_latency``, observed without a lock: coordinator/bucket_histogram.py).

``tpserve:time_per_output_token_seconds`` was the per-request mean under the name vLLM gives a per-token
histogram, so a vLLM dashboard's TPOT panel showed another quantity with about 1/N of its samples.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.bucket_histogram import BucketHistogram
from coordinator.metrics import Metrics
from tests.coordinator.fakes import FakeRankGroup, constant, make_engine, make_params


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("le", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_bucket_histogram_exports_what_prometheus_clients_histogram_does() -> None:
    bounds = (0.001, 0.01, 0.1, 1.0)
    values = [0.0005, 0.001, 0.002, 0.01, 0.05, 0.5, 1.0, 3.0, 0.0, 0.1]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram, reference = BucketHistogram("x_seconds", "x", bounds, ours), Histogram("x_seconds", "x", buckets=bounds,
                                                                                     registry=theirs)
    for value in values:
        histogram.observe(value)
        reference.observe(value)
    expected = {key: value for key, value in _samples(theirs).items() if not key[0].endswith("_created")}
    assert _samples(ours) == expected
    assert expected[("x_seconds_bucket", "0.001")] == 3 and expected[("x_seconds_count", "")] == 10
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketHistogram("y", "y", (1.0, 1.0), CollectorRegistry())


def test_one_inter_token_sample_per_token_after_the_first_and_one_tpot_sample_per_request() -> None:
    metrics = Metrics()
    engine = make_engine(group=FakeRankGroup(sample=constant(7), step_s=0.002), metrics=metrics)

    async def collect(max_tokens: int) -> int:
        return sum([len(out.token_ids) async for out in engine.generate(make_params(max_tokens=max_tokens))])

    async def run() -> list[int]:
        loop = asyncio.create_task(engine.run())
        results = await asyncio.wait_for(asyncio.gather(collect(12), collect(5), collect(1)), 10)
        loop.cancel()
        return results

    assert asyncio.run(run()) == [12, 5, 1]
    samples = _samples(metrics.registry)
    assert samples[("tpserve:inter_token_latency_seconds_count", "")] == 11 + 4
    assert samples[("tpserve:request_time_per_output_token_seconds_count", "")] == 2  # the 1-token one has none
    assert samples[("tpserve:inter_token_latency_seconds_sum", "")] >= 15 * 0.002 * 0.9  # each a step apart
    assert not any(name.startswith("tpserve:time_per_output_token") for name, _ in samples)
