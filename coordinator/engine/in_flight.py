"""A step sent to the ranks whose result the step loop (coordinator/engine/step_loop.py) has not taken yet.

The engine overlaps its per-request work with the ranks (docs/design/scheduling.md, "The engine
loop"): as soon as step t's result is in, it updates the scheduler, plans step t+1 and
dispatches it, and only then detokenizes and streams step t while the ranks compute
t+1. This object is the "t+1" of that loop: the plan, when it left, and the future of
its result. A dispatch that fails is kept as a step whose result raises, so that the
loop handles every worker failure in one place, after the previous step's outputs are
delivered (a restart resumes after them). No torch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from coordinator.worker_client import WorkerGroupError
from tpserve.step import StepPlan, StepResult


class StepSubmitter(Protocol):
    """What the engine needs of a worker group: :meth:`WorkerGroup.submit`."""

    async def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]: ...


@dataclass(slots=True, eq=False)
class InFlightStep:
    """One dispatched step.

    Attributes:
        workers: the group it was sent to (a step of a group since replaced is void).
        plan: what the ranks run.
        dispatched_at: ``time.perf_counter()`` seconds when the plan was handed to the group.
        follows_step: dispatched right after the previous step's result (no idle wait
            between them), so the ranks' wait before it measures the loop, not a lull.
        answer: resolves to rank 0's result, or raises WorkerGroupError.
        seq_ids: with pipeline micro-batches, the sequences it schedules (no other step in
            flight may hold them); empty otherwise.
        suspect: the one sequence it runs, alone, after a failed step (coordinator/engine/probation.py);
            None for every other step.
    """

    workers: StepSubmitter
    plan: StepPlan
    dispatched_at: float
    follows_step: bool
    answer: asyncio.Future[StepResult]
    seq_ids: frozenset[int] = frozenset()
    suspect: int | None = None

    @classmethod
    async def dispatch(cls, workers: StepSubmitter, plan: StepPlan, follows_step: bool) -> InFlightStep:
        """Sends ``plan`` to every rank; returns once it is on its way (never raises WorkerGroupError)."""
        started = time.perf_counter()
        try:
            answer = await workers.submit(plan)
        except WorkerGroupError as exc:
            answer = asyncio.get_running_loop().create_future()
            answer.set_exception(exc)
        return cls(workers, plan, started, follows_step, answer)

    async def result(self) -> StepResult:
        """Rank 0's result.

        Raises:
            WorkerGroupError: a rank failed, closed its stream or timed out, or the plan was not sent.
        """
        return await self.answer

    def cancel(self) -> None:
        """Gives up on the step (the loop is stopping); a failure it already had is not reported again."""
        if self.answer.done():
            if not self.answer.cancelled():
                self.answer.exception()  # retrieved: asyncio logs no "never retrieved" warning
        else:
            self.answer.cancel()
