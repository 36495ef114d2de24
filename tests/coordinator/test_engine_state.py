"""The engine's life cycle as one enum (docs/design/scheduling.md, "The engine's states are one enum"): the allowed
moves, and what each state refuses."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.engine_state import TRANSITIONS, EngineState, check_transition
from coordinator.errors import UnavailableError
from tests.coordinator.overlap_engine import _engine, _params, _run


def test_every_state_has_its_moves_and_dead_is_final() -> None:
    assert set(TRANSITIONS) == set(EngineState)
    assert all(EngineState.DEAD in moves for moves in TRANSITIONS.values())  # any state may fail
    assert TRANSITIONS[EngineState.DEAD] == {EngineState.DEAD}
    with pytest.raises(RuntimeError, match="engine state dead cannot become serving"):
        check_transition(EngineState.DEAD, EngineState.SERVING)
    with pytest.raises(RuntimeError, match="recovering cannot become serving"):
        check_transition(EngineState.RECOVERING, EngineState.SERVING)  # only through RESUMED


def test_suspend_resume_drain_and_fail_move_the_state_and_refuse_requests() -> None:
    async def run() -> list[str]:
        engine, group, _ = _engine()
        seen = []

        async def refused() -> str:
            with pytest.raises(UnavailableError) as info:
                await anext(engine.generate(_params("x", 2)))
            return str(info.value)

        engine.suspend("rank 1 is gone")
        seen.append((engine.state, engine.lifecycle.recovering, await refused()))
        engine.drain()  # a no-op while restarting
        engine.resume(group)
        seen.append((engine.state, engine.lifecycle.recovering, None))
        engine.drain()
        seen.append((engine.state, engine.lifecycle.draining, await refused()))
        engine.fail_all("it broke")
        seen.append((engine.state, engine.lifecycle.dead, await refused()))
        return seen

    recovering, resumed, draining, dead = asyncio.run(run())
    assert recovering[:2] == (EngineState.RECOVERING, "rank 1 is gone") and "restarting" in recovering[2]
    assert resumed == (EngineState.RESUMED, None, None)
    assert draining[:2] == (EngineState.DRAINING, True) and "draining" in draining[2]
    assert dead[:2] == (EngineState.DEAD, "it broke") and "it broke" in dead[2]


def test_the_first_successful_step_after_a_restart_leaves_resumed() -> None:
    engine, group, _ = _engine()
    engine.suspend("lost")
    engine.resume(group)
    (outputs,) = _run(engine, _params("r0", 2))
    assert sum(len(o.token_ids) for o in outputs) == 2 and engine.state is EngineState.SERVING
