"""An engine on a scripted group whose steps overlap, shared by the overlap and engine-state tests."""

from __future__ import annotations

import asyncio

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler
from coordinator.validation import GenerateParams
from tests.coordinator.fakes import FakeRankGroup, make_engine, make_params

# " the cat sat on the mat and ran away" in the embedded model's vocabulary.
SCRIPT = [315, 322, 344, 365, 973, 619, 322, 357, 365, 352, 844, 318, 994]
PROMPT = [1, 5, 6, 8]


def _engine(**group_args) -> tuple[Engine, FakeRankGroup, Metrics]:
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    group, metrics = FakeRankGroup(scheduler=scheduler, **group_args), Metrics()
    return make_engine(group=group, scheduler=scheduler, metrics=metrics), group, metrics


def _params(request_id: str, max_tokens: int, stop: tuple[str, ...] = ()) -> GenerateParams:
    return make_params(request_id=request_id, prompt=PROMPT, max_tokens=max_tokens, stop=stop)


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
