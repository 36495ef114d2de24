"""An engine on a scripted group whose steps overlap, shared by the overlap and engine-state tests."""

from __future__ import annotations

import asyncio

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler
from coordinator.tokenizer import Tokenizer
from coordinator.validation import GenerateParams
from tpserve.embedded_model import default_model_dir
from tpserve.step import SamplingParams, StepPlan, StepResult

# " the cat sat on the mat and ran away" in the embedded model's vocabulary.
SCRIPT = [315, 322, 344, 365, 973, 619, 322, 357, 365, 352, 844, 318, 994]
PROMPT = [1, 5, 6, 8]


class ScriptedGroup:
    """Samples SCRIPT in order for each sequence; records every plan and what happened around it."""

    def __init__(self, scheduler: Scheduler, step_s: float = 0.0, model_execute_s: float = 0.0,
                 wait_s: float = 0.0) -> None:
        self.scheduler = scheduler
        self.step_s, self.model_execute_s, self.wait_s = step_s, model_execute_s, wait_s
        self.plans: list[StepPlan] = []
        self.events: list[tuple[str, int]] = []
        self.sampled: dict[int, int] = {}  # seq id -> tokens sampled for it so far
        self.on_submit = lambda plan: None

    async def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        self.scheduler.check_invariants()  # no step in flight: every block free or held
        self.plans.append(plan)
        self.events.append(("submit", plan.step_id))
        self.on_submit(plan)
        return asyncio.ensure_future(self._run(plan))

    async def execute(self, plan: StepPlan) -> StepResult:
        return await (await self.submit(plan))

    async def _run(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(self.step_s)
        tokens = []
        for chunk in plan.scheduled:
            if chunk.sample:
                index = self.sampled.get(chunk.seq_id, 0)
                self.sampled[chunk.seq_id] = index + 1
                tokens.append(SCRIPT[index % len(SCRIPT)])
        return StepResult(plan.step_id, tuple(tokens), model_execute_time_s=self.model_execute_s,
                          wait_time_s=self.wait_s)


def _engine(**group_args) -> tuple[Engine, ScriptedGroup, Metrics]:
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    group, metrics = ScriptedGroup(scheduler, **group_args), Metrics()
    return Engine(scheduler, group, Tokenizer.from_pretrained(default_model_dir()), 128, 16, metrics), group, metrics


def _params(request_id: str, max_tokens: int, stop: tuple[str, ...] = ()) -> GenerateParams:
    return GenerateParams(request_id, PROMPT, max_tokens, SamplingParams(temperature=0.0), stop, frozenset(), True)


async def _collect(engine: Engine, params: GenerateParams) -> list:
    return [out async for out in engine.generate(params)]


def _run(engine: Engine, *params: GenerateParams) -> list[list]:
    async def go() -> list[list]:
        loop = asyncio.create_task(engine.run())
        try:
            return await asyncio.wait_for(asyncio.gather(*(_collect(engine, p) for p in params)), 10)
        finally:
            loop.cancel()

    return asyncio.run(go())
