"""Keeping a pipeline full: up to P micro-batches of disjoint sequences in flight (vLLM's virtual engines).

With ``--pipeline-parallel-size P`` a step runs its stages one after another: alone,
each stage would idle ``(P - 1) / P`` of the time. So the engine loop keeps up to
``P`` steps in flight: while stage ``s`` computes step ``k``, stage ``s - 1`` computes
step ``k + 1``. Each step's plan is a separate micro-batch: the scheduler leaves out
every sequence of a step still in flight (``Scheduler.schedule(busy=...)``: a sequence
is never in two in-flight batches, and never preempted while a step writes its blocks),
so the running sequences rotate over the micro-batches as their results come back; each
plan takes at most an even share (``ceil(active / P)``) of the active sequences, so
that one batch does not take them all and leave the others empty.

Why this is safe on the ranks: every rank applies the plans in the order they were
sent (one ``Step`` stream per rank); a stage's KV cache holds only its own layers, so
a block freed (an abort) and handed to another sequence in step ``k + 1`` is written
by each stage only after that stage has finished step ``k``. The coordinator reads
the steps' results in order (coordinator/worker_client.py) and applies each with
``Scheduler.update`` before its sequences are scheduled again.

:func:`run_micro_batches` replaces the engine loop's body when ``P > 1``; it drives
the engine through the same calls the one-step loop makes (``schedule``, ``execute``,
``update``, ``_process``, the recovery and failure hooks). No torch.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from coordinator.engine_state import EngineState
from coordinator.worker_client import WorkerGroupError

if TYPE_CHECKING:
    from coordinator.engine import Engine
    from tpserve.step import StepPlan, StepResult


class InFlight:
    """The steps sent and not yet applied, oldest first, and the sequences they hold."""

    def __init__(self) -> None:
        self.steps: deque[tuple[StepPlan, frozenset[int], asyncio.Task]] = deque()
        self.busy: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, plan: StepPlan, task: asyncio.Task) -> None:
        ids = frozenset(chunk.seq_id for chunk in plan.scheduled)
        assert not ids & self.busy, f"sequences {sorted(ids & self.busy)} are already in flight"
        self.steps.append((plan, ids, task))
        self.busy |= ids

    def pop_oldest(self) -> tuple[StepPlan, asyncio.Task]:
        plan, ids, task = self.steps.popleft()
        self.busy -= ids
        return plan, task

    async def drain(self) -> None:
        """Waits for every step in flight to end (a failed group fails them all) and forgets them."""
        tasks = [task for _, _, task in self.steps]
        self.steps.clear()
        self.busy = frozenset()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_micro_batches(engine: Engine, depth: int) -> None:
    """The engine loop with up to ``depth`` steps in flight (module docstring). Returns when the engine is dead."""
    inflight = InFlight()
    scheduler = engine.scheduler
    while True:
        if engine.state is EngineState.DEAD:
            await inflight.drain()
            return
        if not engine.state.runs_steps:
            await inflight.drain()  # their results are void: the restart re-queued every sequence
            engine._state_changed.clear()
            await engine._state_changed.wait()  # RECOVERING: until resume() or fail_all()
            continue
        # Fill the pipeline: each new micro-batch takes only sequences no step in flight holds.
        while len(inflight) < depth and (scheduler.running or scheduler.waiting):
            # An even share of the sequences per micro-batch, so that the batches rotate.
            active = min(len(scheduler.running) + len(scheduler.waiting), scheduler.max_num_seqs)
            plan = scheduler.schedule(busy=inflight.busy, max_seqs=max(1, -(-active // depth)))
            if not (plan.scheduled or plan.finished_seq_ids or plan.trimmed_block_tables):
                break  # every schedulable sequence is in flight, or nothing fits yet
            inflight.add(plan, asyncio.create_task(engine.workers.execute(plan)))
            if not plan.scheduled:
                break  # only drops to send: no more work this turn
        if not inflight:
            # Nothing fits until a running request finishes; admission guarantees one will.
            engine._wakeup.clear()
            await engine._wakeup.wait()
            continue
        oldest = inflight.steps[0][2]
        if len(inflight) < depth:
            # Room in the pipeline: a new request (a wakeup) may start a micro-batch before the oldest returns.
            wakeup = asyncio.ensure_future(engine._wakeup.wait())
            await asyncio.wait({oldest, wakeup}, return_when=asyncio.FIRST_COMPLETED)
            wakeup.cancel()
            engine._wakeup.clear()
            if not oldest.done():
                continue
        plan, task = inflight.pop_oldest()
        try:
            result: StepResult = await task
        except WorkerGroupError as exc:
            await inflight.drain()
            if engine.state is not EngineState.RESUMED and engine._on_group_failure(str(exc)):
                continue  # a restart re-queued every sequence; the steps' work is redone
            engine.fail_all(f"the worker group failed: {exc}")
            return
        if not engine.state.runs_steps:
            continue  # the group was declared lost during this step: its result is void
        if engine.state is EngineState.RESUMED:
            engine._enter(EngineState.SERVING)  # a step succeeded on the restarted group
        engine._process(scheduler.update(plan, result))
        if result.expert_token_counts:
            engine.metrics.add_expert_tokens(result.expert_token_counts)
        engine._update_gauges()
