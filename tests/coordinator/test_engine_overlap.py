"""The overlapped engine loop (docs/design/scheduling.md, "The engine loop") and its step metrics, with stand-in
worker groups (no processes).

Step t+1 is dispatched before step t's tokens are detokenized and streamed; a sequence
that a stop string or an abort ends meanwhile gets no token from t+1, is named to the
workers in the plan after, and leaks no block. The step metrics (tokens per step,
duration, rank 0's execute and wait times, the loop's busy share) carry real values.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from coordinator import metrics as metrics_module
from coordinator.engine_state import EngineState
from coordinator.sequence import FinishReason
from coordinator.worker_client import WorkerGroupError
from tests.coordinator.fakes import FakeRankGroup
from tests.coordinator.overlap_engine import SCRIPT, _engine, _params, _run
from tpserve.step import StepPlan, StepResult


def test_the_next_step_is_dispatched_before_the_previous_one_is_streamed() -> None:
    engine, group, _ = _engine()
    original = engine.active.outputs.process

    def process(outputs) -> None:
        group.events.append(("process", group.plans[-1].step_id))  # while this plan runs on the ranks
        original(outputs)

    engine.active.outputs.process = process
    (outputs,) = _run(engine, _params("r0", 4))
    assert [t for out in outputs for t in out.token_ids] == SCRIPT[:4]
    # Step t's tokens are processed while step t+1 is in flight; the last step has no successor.
    assert group.events == [("submit", 0), ("submit", 1), ("process", 1), ("submit", 2), ("process", 2),
                            ("submit", 3), ("process", 3), ("process", 3)]


def test_a_stop_string_ends_a_sequence_whose_next_step_is_in_flight() -> None:
    engine, group, _ = _engine()
    stopped, full = _run(engine, _params("r0", 10, stop=("sat",)), _params("r1", 8))
    assert "".join(out.text for out in stopped) == "  the cat " and stopped[-1].finish_reason is FinishReason.STOP
    assert stopped[-1].num_completion_tokens == 5  # up to the token holding "sat": not the in-flight step's token
    assert [t for out in full for t in out.token_ids] == SCRIPT[:8]
    # The stopped sequence was in the plan already dispatched (its token there was dropped); the plan
    # after names it to the workers, and no later plan schedules it.
    stop_plan = next(i for i, plan in enumerate(group.plans) if 0 in plan.finished_seq_ids)
    assert group.sampled[0] == 6 and any(c.seq_id == 0 for c in group.plans[stop_plan - 1].scheduled)
    assert not any(c.seq_id == 0 for plan in group.plans[stop_plan:] for c in plan.scheduled)
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_an_abort_while_the_next_plan_is_sent_gets_no_more_tokens() -> None:
    engine, group, _ = _engine()

    def abort_at_step_3(plan: StepPlan) -> None:
        if plan.step_id == 3:  # step 2's tokens are applied, not yet streamed: they go out before the abort
            assert engine.abort_request("r0") == 1

    group.on_submit = abort_at_step_3
    aborted, full = _run(engine, _params("r0", 10), _params("r1", 6))
    assert [t for out in aborted for t in out.token_ids] == SCRIPT[:3]  # steps 0 to 2, none of step 3
    # The output collector may merge the step's tokens into the abort's message (a reader behind).
    assert aborted[-1].finish_reason is FinishReason.ABORT and all(o.finish_reason is None for o in aborted[:-1])
    assert aborted[-1].num_completion_tokens == 3
    assert [t for out in full for t in out.token_ids] == SCRIPT[:6]
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_step_metrics_carry_the_steps_and_the_ranks_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "BUSY_WINDOW_S", 0.02)
    engine, group, metrics = _engine(step_s=0.01, model_execute_s=0.004, wait_s=0.001)
    _run(engine, _params("r0", 5))
    sample = metrics.registry.get_sample_value
    # A prefill of 4 tokens, then 4 decodes of 1.
    assert sample("tpserve:iteration_tokens_total_count") == 5 and sample("tpserve:iteration_tokens_total_sum") == 8
    assert sample("tpserve:model_execute_time_seconds_count") == 5
    assert sample("tpserve:model_execute_time_seconds_sum") == pytest.approx(0.02)
    # Rank 0's wait counts only for steps dispatched right after a result (not the first one).
    assert sample("tpserve:worker_wait_seconds_count") == 4
    assert sample("tpserve:worker_wait_seconds_sum") == pytest.approx(0.004)
    assert sample("tpserve:step_duration_seconds_count") == 5
    assert 5 * 0.01 <= sample("tpserve:step_duration_seconds_sum") < 5
    busy = sample("tpserve:engine_busy_seconds_total")
    fraction = sample("tpserve:engine_busy_fraction")
    assert 0 < busy < sample("tpserve:step_duration_seconds_sum")
    assert 0 < fraction < 1
    assert "tpserve:iteration_tokens_total_bucket" in generate_latest(metrics.registry).decode()


def test_a_step_of_a_replaced_group_that_fails_late_does_not_fail_the_restarted_one() -> None:
    """The group is lost and restarted while a step is in flight on it; that step's failure,
    arriving after the restart, is void: the requests finish on the new group, token-exact."""
    engine, old, _ = _engine()
    new = FakeRankGroup(scheduler=engine.scheduler)

    class Lost(FakeRankGroup):
        async def _run(self, plan: StepPlan) -> StepResult:
            if plan.step_id < 2:
                return await super()._run(plan)
            await asyncio.sleep(0.05)
            raise WorkerGroupError(f"step {plan.step_id}: rank 1 is gone")

    lost = Lost(scheduler=engine.scheduler)
    engine.loop.workers = lost

    def restart(plan: StepPlan) -> None:
        if plan.step_id == 2:
            def swap() -> None:
                engine.suspend("rank 1 is gone")
                new.sampled = dict(lost.sampled)
                engine.resume(new)
            asyncio.get_running_loop().call_soon(swap)

    lost.on_submit = restart
    (outputs,) = _run(engine, _params("r0", 6))
    assert [t for out in outputs for t in out.token_ids] == SCRIPT[:6] and outputs[-1].finish_reason is not None
    assert engine.state is EngineState.SERVING and engine.scheduler.allocator.num_free_blocks == 64
