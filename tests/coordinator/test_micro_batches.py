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

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler
from coordinator.tokenizer import Tokenizer
from coordinator.validation import GenerateParams
from coordinator.worker_client import WorkerGroupError
from tpserve.embedded_model import default_model_dir
from tpserve.step import SamplingParams, StepPlan, StepResult

PROMPT = [1, 5, 6, 8]


class PipelinedGroup:
    """Keeps each step in flight for ``hold_s``; a sequence's k-th sampled token is ``10 + k``."""

    def __init__(self, hold_s: float = 0.01, fail_at: frozenset[int] = frozenset()) -> None:
        self.hold_s, self.fail_at = hold_s, set(fail_at)
        self.in_flight: dict[int, frozenset[int]] = {}  # step id -> its sequences
        self.max_in_flight = 0
        self.overlaps: list[tuple[int, int]] = []  # (step, seq) scheduled while in another step in flight
        self.sampled: dict[int, int] = {}  # seq -> tokens sampled so far
        self.last_step = -1
        self.steps = 0

    async def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        """The engine's dispatch (coordinator/worker_client.py WorkerGroup.submit): the step runs in the background."""
        return asyncio.ensure_future(self.execute(plan))

    async def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step_id > self.last_step  # sent in order
        self.last_step = plan.step_id
        self.steps += 1
        for seq_id in plan.finished_seq_ids:
            self.sampled.pop(seq_id, None)
        for new in plan.new_seqs:
            self.sampled[new.seq_id] = 0
        ids = frozenset(c.seq_id for c in plan.scheduled)
        self.overlaps += [(plan.step_id, s) for other in self.in_flight.values() for s in ids & other]
        self.in_flight[plan.step_id] = ids
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        try:
            await asyncio.sleep(self.hold_s)
            if self.steps in self.fail_at:
                raise WorkerGroupError(f"step {plan.step_id}: rank 3 is gone")
            tokens = []
            for chunk in plan.scheduled:
                if chunk.sample:
                    tokens.append(10 + self.sampled[chunk.seq_id])
                    self.sampled[chunk.seq_id] += 1
            return StepResult(plan.step_id, tuple(tokens))
        finally:
            del self.in_flight[plan.step_id]


def _engine(group: PipelinedGroup, restarted: PipelinedGroup | None = None, depth: int = 2) -> Engine:
    engine: Engine | None = None

    def on_group_failure(reason: str) -> bool:
        engine.suspend(reason)
        asyncio.get_running_loop().call_soon(engine.resume, restarted)
        return restarted is not None

    scheduler = Scheduler(BlockAllocator(128, 4), max_num_seqs=16, max_num_batched_tokens=64)
    engine = Engine(scheduler, group, Tokenizer.from_pretrained(default_model_dir()), 128, 32, Metrics(),
                    on_group_failure=on_group_failure, micro_batches=depth)
    return engine


async def _collect(engine: Engine, n: int) -> list[int]:
    tokens: list[int] = []
    params = GenerateParams("", PROMPT, n, SamplingParams(temperature=0.0), (), frozenset(), True)
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
    group = PipelinedGroup()
    engine = _engine(group, depth=2)
    lengths = [12, 9, 7, 12, 5, 12, 10, 3]
    results = _run(engine, lengths)
    assert results == [[10 + k for k in range(n)] for n in lengths]  # every token, in order
    assert group.max_in_flight == 2  # the pipeline was kept full...
    assert group.overlaps == []  # ...and never with one sequence in two steps
    assert engine.scheduler.allocator.num_free_blocks == 128


def test_pipelined_steps_are_counted_in_the_step_metrics() -> None:
    """One step loop for every mode (issue 42): each micro-batch applied is one observed step, as without pipelining."""
    group = PipelinedGroup()
    engine = _engine(group, depth=3)
    assert _run(engine, [6, 4, 6, 5]) == [[10 + k for k in range(n)] for n in (6, 4, 6, 5)]
    count = engine.metrics.registry.get_sample_value("tpserve:step_duration_seconds_count")
    assert count == group.steps and group.steps >= 6 and group.max_in_flight == 3


def test_depth_one_keeps_one_step_in_flight() -> None:
    group = PipelinedGroup()
    results = _run(_engine(group, depth=1), [6, 6, 6])
    assert results == [[10 + k for k in range(6)]] * 3 and group.max_in_flight == 1


def test_a_failed_step_in_flight_restarts_the_group_and_every_request_completes() -> None:
    first, restarted = PipelinedGroup(fail_at=frozenset({4})), PipelinedGroup()
    engine = _engine(first, restarted, depth=2)
    lengths = [8, 8, 8, 8]
    results = _run(engine, lengths)
    # Recompute on the restarted group: its stand-in numbers tokens from the recomputed prompt, so a
    # resumed request's later tokens restart at 10; what matters is that each completes its length.
    assert [len(r) for r in results] == lengths
    assert restarted.steps > 0 and restarted.overlaps == [] and first.overlaps == []
    assert engine.scheduler.allocator.num_free_blocks == 128
