"""When requests are sent: Poisson (or gamma) arrivals and a concurrency cap.

The semantics of ``vllm bench serve``'s ``--request-rate``, ``--burstiness`` and
``--max-concurrency``:

- Inter-arrival gaps are gamma-distributed with shape ``burstiness`` and scale
  ``1 / (rate * burstiness)``, so their mean is 1 / rate whatever the burstiness.
  burstiness 1 is a Poisson process (exponential gaps); < 1 is burstier, > 1 more
  even. ``rate = inf`` sends every request at once.
- A request's arrival time is fixed by the schedule; under ``max_concurrency`` it then
  waits for a free slot before it is sent, and its latencies are measured from the send.

Unlike vLLM, the gaps are not rescaled afterwards to make the run last exactly
num_requests / rate: a rescaled sequence is no longer a Poisson process. The first
request is sent at time 0.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

Request = TypeVar("Request")
Result = TypeVar("Result")


def inter_arrival_gaps(num_gaps: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """``num_gaps`` gaps in seconds between consecutive sends (all 0 when the rate is inf).

    Raises:
        ValueError: request_rate or burstiness is not positive.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_gaps
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num_gaps)]


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: 0 for the first request, then cumulative gaps."""
    gaps = inter_arrival_gaps(max(num_requests - 1, 0), request_rate, burstiness, random.Random(seed))
    return list(itertools.accumulate(gaps, initial=0.0))[:num_requests]


async def run_load(requests: Sequence[Request], send: Callable[[int, Request], Awaitable[Result]],
                   offsets: Sequence[float], max_concurrency: int | None = None) -> list[Result]:
    """Calls ``send(index, request)`` for each request at its offset (seconds from now); returns the results in order.

    At most ``max_concurrency`` sends are in flight at once (None: no cap). ``send`` should
    catch its own errors: one that raises fails the whole run, like ``asyncio.gather``.

    Raises:
        ValueError: max_concurrency < 1, or the offsets and requests differ in number.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} offsets for {len(requests)} requests")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(index: int, request: Request) -> Result:
        if slots is None:
            return await send(index, request)
        async with slots:
            return await send(index, request)

    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for index, (request, offset) in enumerate(zip(requests, offsets)):
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(index, request)))
    return list(await asyncio.gather(*tasks))
