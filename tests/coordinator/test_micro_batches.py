"""The engine with pipeline micro-batches (coordinator/engine/step_loop.py), on a stand-in worker group.

The stand-in holds every step for a while and answers each sampled chunk with the
next token of a fixed completion, so it checks what the loop may send: up to P steps
in flight, never one sequence in two of them (its next token is not known yet), and
results applied in order; every request must still get its completion, token for
token, and every block must come back. A failing step in flight restarts the group
(the others in flight are drained) and every request still completes.
"""

from __future__ import annotations

import asyncio

from coordinator.engine import Engine
from tests.coordinator.fakes import FakeRankGroup, make_engine, make_params

PROMPT = [1, 5, 6, 8]


def pipelined_group(fail_at: frozenset[int] | set[int] = frozenset()) -> FakeRankGroup:
    """Keeps each step in flight for 10 ms; a sequence's k-th sampled token is ``10 + k``; the steps numbered
    in ``fail_at`` fail (rank 3 is gone)."""
    return FakeRankGroup(sample=lambda k, step: 10 + k, step_s=0.01, fail_at=fail_at, fail_rank=3)


def _engine(group: FakeRankGroup, restarted: FakeRankGroup | None = None, depth: int = 2) -> Engine:
    engine: Engine | None = None

    def on_group_failure(reason: str) -> bool:
        engine.suspend(reason)
        asyncio.get_running_loop().call_soon(engine.resume, restarted)
        return restarted is not None

    engine = make_engine(group=group, num_blocks=128, max_num_seqs=16, max_queue_len=32,
                         on_group_failure=on_group_failure, micro_batches=depth)
    return engine


async def _collect(engine: Engine, n: int) -> list[int]:
    tokens: list[int] = []
    params = make_params(prompt=PROMPT, max_tokens=n)
    async for out in engine.generate(params):
        tokens.extend(out.token_ids)
    return tokens


def _run(engine: Engine, lengths: list[int]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        loop = asyncio.create_task(engine.run())
        try:
            return await asyncio.wait_for(asyncio.gather(*(_collect(engine, n) for n in lengths)), 20)
        finally:
            loop.cancel()

    return asyncio.run(run())


def test_two_micro_batches_of_disjoint_sequences_stay_in_flight() -> None:
    group = pipelined_group()
    engine = _engine(group, depth=2)
    lengths = [12, 9, 7, 12, 5, 12, 10, 3]
    results = _run(engine, lengths)
    assert results == [[10 + k for k in range(n)] for n in lengths]  # every token, in order
    assert group.max_in_flight == 2  # the pipeline was kept full...
    assert group.overlaps == []  # ...and never with one sequence in two steps
    assert engine.scheduler.allocator.num_free_blocks == 128


def test_pipelined_steps_are_counted_in_the_step_metrics() -> None:
    """One step loop for every mode (docs/design/scheduling.md, "The engine loop"): each micro-batch applied is one observed step, as without pipelining."""
    group = pipelined_group()
    engine = _engine(group, depth=3)
    assert _run(engine, [6, 4, 6, 5]) == [[10 + k for k in range(n)] for n in (6, 4, 6, 5)]
    count = engine.metrics.registry.get_sample_value("tpserve:step_duration_seconds_count")
    assert count == group.steps and group.steps >= 6 and group.max_in_flight == 3


def test_depth_one_keeps_one_step_in_flight() -> None:
    group = pipelined_group()
    results = _run(_engine(group, depth=1), [6, 6, 6])
    assert results == [[10 + k for k in range(6)]] * 3 and group.max_in_flight == 1


def test_a_failed_step_in_flight_restarts_the_group_and_every_request_completes() -> None:
    first, restarted = pipelined_group(fail_at={4}), pipelined_group()
    engine = _engine(first, restarted, depth=2)
    lengths = [8, 8, 8, 8]
    results = _run(engine, lengths)
    # Recompute on the restarted group: its stand-in numbers tokens from the recomputed prompt, so a
    # resumed request's later tokens restart at 10; what matters is that each completes its length.
    assert [len(r) for r in results] == lengths
    assert restarted.steps > 0 and restarted.overlaps == [] and first.overlaps == []
    assert engine.scheduler.allocator.num_free_blocks == 128
