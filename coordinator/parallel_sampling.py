"""Parallel sampling: ``n`` completions of one prompt, the prompt computed once.

Sample 0 is queued first; once its prompt has been computed (its first output, when
the scheduler has already put the prompt's full blocks in the prefix cache), samples
1 to n-1 are queued and find those blocks there: each computes only the prompt's last,
partial block, and the blocks are shared (reference-counted) while the samples run.
So ``n`` costs one prefill, not ``n`` (with prefix caching on; with it off, each sample
computes its prompt). Sample ``i`` draws its noise from ``seed + i``, so the samples
differ, and a seeded request is reproducible sample by sample.

The ``n`` samples are admitted together when the request arrives (``Engine.admit``): their
queue places are held until each is queued, so the request is refused whole
(RESOURCE_EXHAUSTED) or not at all, never after a sample has streamed (docs/design/request-path.md, "`n` > 1").

Every sample carries the request's id and shares its entry in the engine's request table:
an Abort of that id ends them all, those running and those not started yet (each ends
with finish_reason ABORT). Leaving the iteration early aborts the samples still running.
No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from coordinator.engine import Engine, RequestOutput
from coordinator.request_table import RequestEntry
from coordinator.sampling_controls import field_value
from coordinator.validation import GenerateParams
from tpserve import sampling_fields
from tpserve.step import SEED_MODULUS
from tpserve.v1 import generate_pb2 as pb

#: Most completions one request may ask for (vLLM has no limit; this bounds one caller's share).
MAX_N = sampling_fields.MAX_N


def num_samples(params: pb.SamplingParams) -> int:
    """The request's ``n``, checked.

    Raises:
        InvalidArgumentError: ``n`` outside [1, MAX_N].
    """
    return field_value(params, "n")  # range: tpserve/sampling_fields.py


def sample_params(params: GenerateParams, index: int) -> GenerateParams:
    """The parameters of sample ``index``: the request's, its seed moved on by ``index``."""
    if index == 0:
        return params
    sampling = dataclasses.replace(params.sampling, seed=(params.sampling.seed + index) % SEED_MODULUS)
    return dataclasses.replace(params, sampling=sampling)


async def generate_n(engine: Engine, params: GenerateParams, n: int,
                     timeout_s: float | None = None, stream_interval: int | None = None,
                     entry: RequestEntry | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields ``(sample index, output)`` of ``n`` samples of ``params`` until all have finished
    (``stream_interval``: :meth:`Engine.generate`'s, for every sample).

    Args:
        entry: the request as its handler registered it on receipt (``engine.requests.open``
            with ``n``); None registers it here.

    Raises:
        The first error of any sample (:meth:`Engine.generate`'s); the others are then aborted.
        ResourceExhaustedError, UnavailableError: before any sample started, for all ``n``.
    """
    if n == 1:
        async for output in engine.generate(params, timeout_s, stream_interval, entry):
            yield 0, output
        return
    own_entry = entry is None
    entry = engine.requests.open(params.request_id, params.tenant, n) if entry is None else entry
    outputs: asyncio.Queue = asyncio.Queue()
    prefilled = asyncio.Event()

    async def run(index: int) -> None:
        try:
            async for output in engine.generate(sample_params(params, index), timeout_s, stream_interval, entry):
                prefilled.set()
                outputs.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the caller's iteration
            outputs.put_nowait((index, exc))
        finally:
            prefilled.set()  # a first sample that failed must not hold the others back
            outputs.put_nowait((index, None))

    tasks = []
    try:
        if not entry.aborted:  # (aborted: every sample ends at once, with finish_reason ABORT)
            engine.admit(params, entry)  # all n queue places, or RESOURCE_EXHAUSTED before any sample
        tasks.append(asyncio.create_task(run(0)))
        await prefilled.wait()
        tasks += [asyncio.create_task(run(index)) for index in range(1, n)]  # an Abort meanwhile ends each at once
        running = n
        while running:
            index, output = await outputs.get()
            if output is None:
                running -= 1
            elif isinstance(output, Exception):
                raise output
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()  # ends engine.generate, which aborts a sample still running
        await asyncio.gather(*tasks, return_exceptions=True)
        if own_entry:
            engine.requests.close(entry)
