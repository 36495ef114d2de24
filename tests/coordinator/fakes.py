"""Stand-in worker groups and constants shared by the coordinator's engine tests (no processes, no torch)."""

from __future__ import annotations

import asyncio

from coordinator.sequence import Sequence, StopParams
from coordinator.worker_client import WorkerGroupError
from tpserve.step import SamplingParams, StepPlan, StepResult

# " the cat sat on the mat and ran away" in the embedded model's vocabulary (no eos among them).
SCRIPT = [315, 322, 344, 365, 973, 619, 322, 357, 365, 352, 844, 318, 994]
PROMPT = [1, 5, 6, 8, 9, 10, 11, 12, 13, 14]  # 2.5 blocks of 4: samples of one request share two
VOCAB_SIZE, MAX_MODEL_LEN = 1024, 4096


class ScriptedGroup:
    """A worker group that samples SCRIPT in order for each sequence, ``step_s`` seconds a step;
    rank 0 builds a grammar in ``grammar_s`` seconds. Records the sequences it ever ran."""

    def __init__(self, step_s: float = 0.002, grammar_s: float = 0.0, first_step_s: float | None = None) -> None:
        self.step_s, self.grammar_s = step_s, grammar_s
        self.first_step_s = step_s if first_step_s is None else first_step_s
        self.sampled: dict[int, int] = {}  # seq id -> tokens sampled for it so far
        self.seen: set[int] = set()

    async def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        return asyncio.ensure_future(self._run(plan))

    async def execute(self, plan: StepPlan) -> StepResult:
        return await (await self.submit(plan))

    async def prepare_grammar(self, grammar: str) -> None:
        await asyncio.sleep(self.grammar_s)

    async def _run(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(self.step_s if self.seen else self.first_step_s)
        tokens = []
        for chunk in plan.scheduled:
            self.seen.add(chunk.seq_id)
            if chunk.sample:
                index = self.sampled.get(chunk.seq_id, 0)
                self.sampled[chunk.seq_id] = index + 1
                tokens.append(SCRIPT[index % len(SCRIPT)])
        return StepResult(plan.step_id, tuple(tokens))


class FakeGroup:
    """Answers steps with token 7 for every sampled chunk; fails the steps numbered in ``fail_at``."""

    def __init__(self, fail_at: set[int] = frozenset()) -> None:
        self.fail_at = set(fail_at)
        self.steps = 0

    async def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        await asyncio.sleep(0)
        if self.steps in self.fail_at:
            raise WorkerGroupError(f"step {plan.step_id}: rank 1 is gone")
        return StepResult(plan.step_id, tuple(7 for c in plan.scheduled if c.sample))

    async def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        return asyncio.ensure_future(self.execute(plan))


EOS = 2


def make_seq(seq_id: int, prompt: list[int], max_tokens: int, max_model_len: int = 96,
             sampling: SamplingParams | None = None) -> Sequence:
    return Sequence(seq_id, list(prompt), sampling or SamplingParams(temperature=0.0),
                    StopParams(max_tokens, frozenset({EOS})), max_model_len)
