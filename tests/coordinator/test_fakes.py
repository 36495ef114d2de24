"""The shared stand-in worker group (tests/coordinator/fakes.py) does what the engine tests rely on."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.worker_client import WorkerGroupError
from tests.coordinator.fakes import SCRIPT, FakeRankGroup, constant, make_engine, make_params
from tpserve.step import ScheduledChunk, StepPlan


def _plan(step_id: int, *seq_ids: int) -> StepPlan:
    return StepPlan(step_id, scheduled=tuple(ScheduledChunk(seq_id, (5,), 0, sample=True) for seq_id in seq_ids))


def test_each_sequence_samples_the_script_in_order_and_every_step_is_recorded() -> None:
    async def run() -> tuple[list, FakeRankGroup]:
        group = FakeRankGroup()
        results = [await group.execute(_plan(i, 1, 2)) for i in range(3)]
        return results, group

    results, group = asyncio.run(run())
    assert [r.sampled_token_ids for r in results] == [(SCRIPT[k], SCRIPT[k]) for k in range(3)]
    assert group.steps == 3 and group.sampled == {1: 3, 2: 3} and group.seen == {1, 2}
    assert group.events == [("submit", 0), ("submit", 1), ("submit", 2)] and len(group.plans) == 3


def test_a_numbered_step_fails_and_overlapping_steps_are_counted() -> None:
    async def run() -> tuple[FakeRankGroup, str]:
        group = FakeRankGroup(sample=constant(7), step_s=0.01, fail_at={2}, fail_rank=3)
        first, second = await group.submit(_plan(0, 1)), await group.submit(_plan(1, 1, 2))
        assert (await first).sampled_token_ids == (7,)
        with pytest.raises(WorkerGroupError) as failed:
            await second
        return group, str(failed.value)

    group, message = asyncio.run(run())
    assert message == "step 1: rank 3 is gone" and group.max_in_flight == 2 and group.overlaps == [(1, 1)]


def test_plans_out_of_step_order_are_refused() -> None:
    async def run() -> None:
        group = FakeRankGroup()
        await group.execute(_plan(4, 1))
        await group.submit(_plan(3, 1))

    with pytest.raises(AssertionError, match="step 3 sent after step 4"):
        asyncio.run(run())


def test_the_builders_take_keywords_only() -> None:
    with pytest.raises(TypeError):
        make_engine(FakeRankGroup())  # positional: refused
    with pytest.raises(TypeError):
        make_params([1, 5, 6, 8], 4)  # positional: refused
    params = make_params(max_tokens=4, request_id="r")
    assert (params.prompt_token_ids, params.max_tokens, params.sampling.temperature, params.ignore_eos) == (
        [1, 5, 6, 8], 4, 0.0, True)
    engine = make_engine(group=FakeRankGroup(), max_model_len=96)
    assert engine.max_model_len == 96 and engine.scheduler.allocator.num_free_blocks == 64
