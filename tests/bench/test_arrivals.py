"""Arrival times: the Poisson/gamma gaps, sending all at once at rate inf, and the concurrency cap."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from tpserve.bench.arrivals import arrival_offsets, inter_arrival_gaps, run_load


@pytest.mark.parametrize("rate", [0.5, 8.0, 200.0])
@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_empirical_rate_is_the_asked_rate(rate: float, burstiness: float) -> None:
    gaps = inter_arrival_gaps(2000, rate, burstiness, random.Random(1234))
    assert len(gaps) == 2000 and min(gaps) > 0
    assert len(gaps) / sum(gaps) == pytest.approx(rate, rel=0.05)
    # Gamma with shape k has a coefficient of variation 1/sqrt(k): 1 for Poisson (exponential gaps).
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_seeded_offsets_repeat_and_start_at_zero() -> None:
    offsets = arrival_offsets(50, 4.0, 1.0, seed=7)
    assert offsets == arrival_offsets(50, 4.0, 1.0, seed=7) != arrival_offsets(50, 4.0, 1.0, seed=8)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(offsets) == 50
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_bad_rate_or_burstiness_is_refused() -> None:
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            inter_arrival_gaps(3, rate, burstiness, random.Random(0))


def send_log(hold_s: float):
    """A fake send that records its start time (loop clock) and the number in flight."""
    log = {"starts": [], "in_flight": 0, "max_in_flight": 0}

    async def send(index: int, request: str) -> str:
        log["starts"].append(asyncio.get_running_loop().time())
        log["in_flight"] += 1
        log["max_in_flight"] = max(log["max_in_flight"], log["in_flight"])
        await asyncio.sleep(hold_s * random.Random(index).random())
        log["in_flight"] -= 1
        return f"done {request}"

    return log, send


def test_inf_sends_everything_at_once() -> None:
    log, send = send_log(hold_s=0.05)
    requests = [f"r{i}" for i in range(200)]
    results = asyncio.run(run_load(requests, send, arrival_offsets(200, math.inf, 1.0, 0)))
    assert results == [f"done r{i}" for i in range(200)]
    # Every send started before any returned: some hold for well under a millisecond (their holds are
    # 0.05 s times a seeded uniform draw), so a runner that spaced its sends at all would let one of
    # those finish first. Stricter than a bound on the starts' wall-clock spread, which a 2-core host
    # stalling the whole process stretched to 266 ms in one CI run though nothing waited for anything.
    assert log["max_in_flight"] == 200
    assert min(0.05 * random.Random(i).random() for i in range(200)) < 1e-3  # the premise of the line above


def test_sends_follow_the_offsets() -> None:
    log, send = send_log(hold_s=0.0)
    offsets = [0.0, 0.05, 0.06, 0.2]
    asyncio.run(run_load(list("abcd"), send, offsets))
    elapsed = [t - log["starts"][0] for t in log["starts"]]
    for actual, planned in zip(elapsed, offsets):
        assert planned <= actual + 1e-3 and actual < planned + 0.03


@pytest.mark.parametrize("rate", [math.inf, 400.0])
def test_max_concurrency_is_never_exceeded(rate: float) -> None:
    log, send = send_log(hold_s=0.02)
    requests = list(range(60))
    results = asyncio.run(run_load(requests, send, arrival_offsets(60, rate, 1.0, 3), max_concurrency=4))
    assert len(results) == 60 and len(log["starts"]) == 60
    assert log["max_in_flight"] == 4  # reached, and never more


def test_bad_concurrency_is_refused() -> None:
    log, send = send_log(hold_s=0.0)
    with pytest.raises(ValueError, match="max-concurrency"):
        asyncio.run(run_load([1], send, [0.0], max_concurrency=0))
