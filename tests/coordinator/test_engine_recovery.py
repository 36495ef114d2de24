"""The engine's side of a group restart, with stand-in worker groups (no processes).

A failed step suspends the engine (every sequence re-queued for recompute) and the
engine continues on the group it is given, running the failed step's sequences alone
first: a request that breaks every group fails by itself (coordinator/engine/probation.py).
A group that fails whatever it runs fails every request instead of restarting forever.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.engine import Engine
from coordinator.engine_state import EngineState
from coordinator.errors import TpserveError, UnavailableError
from coordinator.validation import GenerateParams
from tests.coordinator.fakes import FakeRankGroup, constant, make_engine, make_params


def _engine(first: FakeRankGroup, restarted: FakeRankGroup, restarts: list[str]) -> Engine:
    engine: Engine | None = None

    def on_group_failure(reason: str) -> bool:
        restarts.append(reason)
        engine.suspend(reason)
        asyncio.get_running_loop().call_soon(engine.resume, restarted)
        return True

    engine = make_engine(group=first, on_group_failure=on_group_failure)
    return engine


def _params(n: int) -> GenerateParams:
    return make_params(prompt=[1, 5, 6, 8], max_tokens=n)


async def _collect(engine: Engine, n: int) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(_params(n)):
        tokens.extend(out.token_ids)
    return tokens


def test_a_failed_step_restarts_and_every_request_completes() -> None:
    async def run() -> tuple[list[list[int]], list[str], int]:
        restarts: list[str] = []
        engine = _engine(FakeRankGroup(sample=constant(7), fail_at={3}), FakeRankGroup(sample=constant(7)), restarts)
        loop = asyncio.create_task(engine.run())
        results = await asyncio.wait_for(asyncio.gather(_collect(engine, 6), _collect(engine, 4)), 10)
        loop.cancel()
        return results, restarts, engine.scheduler.allocator.num_free_blocks

    results, restarts, free = asyncio.run(run())
    assert results == [[7] * 6, [7] * 4] and restarts == ["step 2: rank 1 is gone"] and free == 64


def _run_until_done(engine: Engine, prompts: list[tuple[int, ...]], n: int) -> list[list[int] | BaseException]:
    async def collect(prompt: tuple[int, ...]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(make_params(prompt=prompt, max_tokens=n)):
            tokens.extend(out.token_ids)
        return tokens

    async def run() -> list[list[int] | BaseException]:
        loop = asyncio.create_task(engine.run())
        try:
            return await asyncio.wait_for(asyncio.gather(*map(collect, prompts), return_exceptions=True), 10)
        finally:
            loop.cancel()

    return asyncio.run(run())


POISON = 99  # a token the fake groups fail on (FakeRankGroup ``poison_token``)


def test_a_request_that_breaks_every_group_fails_alone_and_the_others_complete() -> None:
    """Two restarts: the first makes the failed step's three sequences suspects; each then runs alone
    (its recompute and a decode step) and the poisoned one's solo step fails it alone."""
    restarts: list[str] = []
    first = FakeRankGroup(sample=constant(7), poison_token=POISON)
    restarted = FakeRankGroup(sample=constant(7), poison_token=POISON)
    engine = _engine(first, restarted, restarts)
    results = _run_until_done(engine, [(1, 5, 6, 8), (1, 5, POISON, 8), (1, 2, 3)], 5)
    assert results[0] == [7] * 5 and results[2] == [7] * 5
    assert isinstance(results[1], TpserveError) and not isinstance(results[1], UnavailableError)
    assert "failed twice on steps holding this request, the second time running it alone" in str(results[1])
    assert len(restarts) == 2 and engine.scheduler.allocator.num_free_blocks == 64
    # On the restarted group the suspects ran one at a time (the first of them first), then together.
    solo = [plan for plan in restarted.plans if plan.scheduled][:3]
    assert [len(plan.scheduled) for plan in solo] == [1, 1, 1]
    assert engine.lifecycle.state is EngineState.SERVING


def test_a_transient_failure_clears_every_suspect_and_each_stream_is_exact() -> None:
    restarts: list[str] = []
    engine = _engine(FakeRankGroup(sample=constant(7), fail_at={2}), FakeRankGroup(sample=constant(7)), restarts)
    results = _run_until_done(engine, [(1, 5, 6, 8), (1, 2, 3), (4, 4)], 6)
    assert results == [[7] * 6] * 3 and len(restarts) == 1
    assert not engine.loop.probation and engine.scheduler.allocator.num_free_blocks == 64


def test_a_group_that_fails_whatever_it_runs_fails_every_request_after_three_failures() -> None:
    """A broken group (a bad checkpoint): the step after each restart fails too. The first failure makes
    suspects, the second fails one of them (it ran alone), the third, with no step succeeding between
    them, fails every request and the engine stops: new requests are refused."""
    restarts: list[str] = []
    broken = FakeRankGroup(sample=constant(7), fail_at=range(1, 100))
    engine = _engine(FakeRankGroup(sample=constant(7), fail_at={2}), broken, restarts)
    results = _run_until_done(engine, [(1, 5, 6, 8), (1, 2, 3)], 6)
    assert all(isinstance(result, TpserveError) for result in results)
    assert sum("the worker group failed: step" in str(result) for result in results) == 1, results
    assert len(restarts) == 2 and engine.lifecycle.state is EngineState.DEAD

    async def late() -> None:
        async for _ in engine.generate(_params(1)):
            pass

    with pytest.raises(UnavailableError):  # the engine is dead: new requests are refused
        asyncio.run(late())
