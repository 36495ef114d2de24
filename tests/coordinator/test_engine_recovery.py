"""The engine's side of a group restart, with stand-in worker groups (no processes).

A failed step suspends the engine (every sequence re-queued for recompute) and the
engine continues on the group it is given. A step that fails again on a freshly
restarted group fails every request instead of restarting forever.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.engine import Engine
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


def test_a_step_that_fails_right_after_a_restart_fails_the_requests() -> None:
    async def run() -> tuple[BaseException, list[str]]:
        restarts: list[str] = []
        engine = _engine(FakeRankGroup(sample=constant(7), fail_at={2}),
                         FakeRankGroup(sample=constant(7), fail_at={1}), restarts)
        loop = asyncio.create_task(engine.run())
        with pytest.raises(TpserveError) as info:
            await asyncio.wait_for(_collect(engine, 6), 10)
        with pytest.raises(UnavailableError):  # the engine is dead: new requests are refused
            await _collect(engine, 1)
        loop.cancel()
        return info.value, restarts

    error, restarts = asyncio.run(run())
    assert len(restarts) == 1 and "the worker group failed" in str(error)
