"""The step loop: one deque of steps in flight, of depth D, for every mode
(docs/design/scheduling.md, "The engine loop").

- D = 1, plain: when step t's result arrives the loop applies it to the scheduler
  (token bookkeeping, token-level stops), plans and dispatches step t+1, and only then
  detokenizes and streams step t while the ranks run t+1 (request-path.md). A sequence that a
  stop string, a cancel or an abort ends meanwhile is in t+1's plan: its token from t+1
  is dropped (``Scheduler.update`` skips a finished sequence) and the plan after names
  it to the workers. Its blocks are freed at once; a later plan may give them to another
  sequence, but the ranks run plans in the order sent, so every step that still writes
  them for the finished sequence has run before that plan's does.
- D = 2, async scheduling (``--async-scheduling``): t+1 is planned and sent before t's
  result arrives (the scheduler counts a planned sample as pending; the ranks feed their
  own sampled token in its place), so a rank that ends a step finds the next plan waiting.
- D = P, pipeline stages (``--pipeline-parallel-size P``, vLLM's virtual engines): while
  stage s computes step k, stage s - 1 computes step k + 1. Each step is a micro-batch of
  sequences no other step in flight holds (``Scheduler.schedule(busy=...)``: a sequence's
  next token is not known yet, and it is never preempted while a step writes its blocks),
  each taking at most an even share (``ceil(active / P)``) of the active sequences, so
  that the batches rotate. A stage's KV cache holds only its own layers and every rank
  applies plans in the order sent, so a block freed in step k and reused in step k + 1 is
  written by each stage only after it has finished step k. With a stage free, a new
  request may start a micro-batch before the oldest step's result is in.

A failed step voids every step in flight; the group is restarted (every sequence is
re-queued and recomputed) or every request fails. After a restart the failed step's
sequences run one at a time, alone, so that a request that breaks the group fails by
itself (coordinator/engine/probation.py). No torch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from coordinator.engine.gauges import GaugeUpdater
from coordinator.engine.in_flight import InFlightStep
from coordinator.engine.lifecycle import Lifecycle
from coordinator.engine.probation import Probation
from coordinator.engine.requests import ActiveRequests
from coordinator.engine_state import EngineState
from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler
from coordinator.worker_client import WorkerGroup, WorkerGroupError
from tpserve.step import StepPlan


class StepLoop:
    """Schedules, dispatches, applies and streams steps, up to ``depth`` in flight.

    Args:
        workers: the group steps go to (replaced on a restart: :attr:`workers`).
        depth: steps in flight at most: 1 plain, 2 async scheduling, P pipeline stages.
        pipelined: each step's sequences are kept out of the others in flight (micro-batches).
        on_group_failure: called with the reason when a step fails; True: the group is
            being restarted (the loop waits for the life cycle to move on).
        fail_all: called with the reason when the requests must fail (INTERNAL).
    """

    def __init__(self, scheduler: Scheduler, workers: WorkerGroup, lifecycle: Lifecycle, active: ActiveRequests,
                 gauges: GaugeUpdater, metrics: Metrics, depth: int, pipelined: bool,
                 on_group_failure: Callable[[str], bool], fail_all: Callable[[str], None]) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.scheduler, self.workers, self.lifecycle, self.active = scheduler, workers, lifecycle, active
        self.gauges, self.metrics = gauges, metrics
        self.depth, self.pipelined = depth, pipelined
        self.on_group_failure, self.fail_all = on_group_failure, fail_all
        self.in_flight: deque[InFlightStep] = deque()  # dispatched, results not taken yet, oldest first
        self.busy: frozenset[int] = frozenset()  # pipelined: the sequences of the steps in flight
        self.probation = Probation()
        self._alone: int | None = None  # the suspect the last plan runs alone

    async def run(self) -> None:
        """Steps while there is work, sleeps while there is none; returns when the engine is DEAD."""
        in_flight, lifecycle = self.in_flight, self.lifecycle
        try:
            while True:
                if not in_flight or not lifecycle.state.runs_steps:
                    self.drop()  # steps of a group declared lost are void: a restart re-queued their work
                    if lifecycle.state is EngineState.DEAD:
                        return  # the restart failed, or the group failed whatever it ran: every request has its error
                    if not lifecycle.state.runs_steps:
                        await lifecycle.wait_changed()  # RECOVERING: until resume() or fail_all()
                        continue
                    await self._top_up(follows_step=False)
                    if not in_flight:
                        self.metrics.end_busy_window()
                        await lifecycle.wait_for_work()
                        continue
                if self.pipelined and len(in_flight) < self.depth and not await self._oldest_or_wakeup():
                    await self._top_up(follows_step=False)  # a new request may start a micro-batch
                    continue
                await self._complete()
        finally:
            self.drop()  # cancelled (shutdown) while steps ran

    def _plan(self) -> StepPlan | None:
        """The next step's plan; None when there is nothing to run or nothing fits (until a
        running request finishes or a new one arrives: admission guarantees one will fit)."""
        scheduler = self.scheduler
        self._alone = None
        if not (scheduler.running or scheduler.waiting):
            return None
        if self.probation and (suspect := self.probation.next(self.active.states)) is not None:
            if self.in_flight:
                return None  # a suspect's step is the only one in flight
            plan = scheduler.schedule_alone(suspect)
            self._alone = suspect.seq_id
        elif self.pipelined:  # an even share of the sequences per micro-batch, so that the batches rotate
            active = min(len(scheduler.running) + len(scheduler.waiting), scheduler.max_num_seqs)
            plan = scheduler.schedule(busy=self.busy, max_seqs=max(1, -(-active // self.depth)))
        else:
            plan = scheduler.schedule()
        if plan.scheduled:
            return plan
        scheduler.take_back(plan)  # its drops and trims go with the next plan
        return None

    async def _top_up(self, follows_step: bool) -> None:
        """Dispatches plans until ``depth`` steps are in flight or nothing more can be planned.
        ``follows_step``: the first comes right after a step's result (no idle wait before it)."""
        in_flight = self.in_flight
        while len(in_flight) < self.depth and self.lifecycle.state.runs_steps \
                and (not in_flight or in_flight[-1].workers is self.workers):
            plan = self._plan()
            if plan is None:
                return
            step = await InFlightStep.dispatch(self.workers, plan, follows_step)
            step.suspect = self._alone
            if self.pipelined:
                step.seq_ids = frozenset(chunk.seq_id for chunk in plan.scheduled)
                assert not step.seq_ids & self.busy, f"sequences {sorted(step.seq_ids & self.busy)} are in flight"
                self.busy |= step.seq_ids
            in_flight.append(step)
            follows_step = True

    async def _oldest_or_wakeup(self) -> bool:
        """Pipelined with a stage free: waits for the oldest step's result or a wakeup (a new
        request, a transition); True when the result is in."""
        oldest = self.in_flight[0].answer
        if not oldest.done():
            wakeup = asyncio.ensure_future(self.lifecycle.wakeup.wait())
            await asyncio.wait((oldest, wakeup), return_when=asyncio.FIRST_COMPLETED)
            wakeup.cancel()
            self.lifecycle.wakeup.clear()
        return oldest.done()

    async def _complete(self) -> None:
        """Takes the oldest step's result, dispatches the next steps, then streams the step's
        tokens while the ranks run what is in flight."""
        step = self.in_flight.popleft()
        if step.seq_ids:
            self.busy -= step.seq_ids
        try:
            result = await step.result()
        except WorkerGroupError as exc:
            self.drop()  # later steps of a failed group are void
            if step.workers is not self.workers:
                return  # a step of the lost group, which was replaced meanwhile: nothing to report
            self._failed(step, str(exc))
            return
        self.probation.step_succeeded()
        received = time.perf_counter()
        lifecycle = self.lifecycle
        if not lifecycle.state.runs_steps or step.workers is not self.workers:
            self.drop()
            return  # the group was declared lost during this step: its result is void
        if lifecycle.state is EngineState.RESUMED:
            lifecycle.enter(EngineState.SERVING)  # a step succeeded on the restarted group
        active = self.active
        active.unstreamed = self.scheduler.update(step.plan, result)
        await self._top_up(follows_step=True)
        outputs, active.unstreamed = active.unstreamed, []
        if lifecycle.state is not EngineState.DEAD:  # (fail_all, meanwhile, gave every request its error)
            active.outputs.process(outputs)
        if result.expert_token_counts:
            self.metrics.add_expert_tokens(result.expert_token_counts)
        self.gauges.update(step_streamed=True)
        if step.plan.num_steps > 1:
            self.metrics.observe_follow_on_steps(step.plan.num_tokens, step.plan.num_steps - 1)
        self.metrics.observe_step(step.plan.num_tokens, received - step.dispatched_at, result.model_execute_time_s,
                                  result.wait_time_s if step.follows_step else None, received, time.perf_counter())

    def _failed(self, step: InFlightStep, reason: str) -> None:
        """A step failed: its sequences become suspects and the group restarts; a suspect that failed
        a step alone fails by itself; a group that fails whatever it runs fails every request."""
        probation = self.probation
        if probation.step_failed():  # (a bad checkpoint, a broken device: give up rather than loop)
            self.fail_all(f"the worker group failed: {reason}")
            return
        if step.suspect is not None:
            probation.convict(step.suspect)
            self.active.fail_one(step.suspect, "the worker group failed twice on steps holding this request, the "
                                 f"second time running it alone; the request was failed, not retried: {reason}")
        else:
            states = self.active.states
            probation.suspect(states[chunk.seq_id].seq for chunk in step.plan.scheduled if chunk.seq_id in states)
        if not self.on_group_failure(reason):
            self.fail_all(f"the worker group failed: {reason}")
        # or a restart re-queued every sequence: the plan's work is redone

    def drop(self) -> None:
        """Gives up on every step in flight (their group failed or was replaced, or the loop stops)."""
        in_flight = self.in_flight
        while in_flight:
            in_flight.popleft().cancel()
        self.busy = frozenset()
