"""Preemptions are visible: ``tpserve:num_preemptions_total`` and one INFO line each, without request content.

An engine over a stand-in worker group and a KV pool too small for its requests at once
(preemptions were counted by the scheduler but neither exported nor logged).
"""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from structlog.testing import capture_logs

from coordinator.block_allocator import BlockAllocator
from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler
from tests.coordinator.fakes import FakeRankGroup, constant, make_engine, make_params, make_seq

PROMPT = [1, 5, 6, 8]


def test_each_preemption_is_counted_and_logged_without_the_prompt() -> None:
    metrics = Metrics()
    # 6 blocks of 4 tokens; three requests of 4 + 12 tokens (4 blocks each) cannot all run.
    scheduler = Scheduler(BlockAllocator(6, 4), max_num_seqs=8, max_num_batched_tokens=64)
    engine = make_engine(group=FakeRankGroup(sample=constant(7)), scheduler=scheduler, max_model_len=64, metrics=metrics)

    async def collect(request_id: str) -> list[int]:
        params = make_params(request_id=request_id, prompt=PROMPT, max_tokens=12)
        return [t for out in [o async for o in engine.generate(params)] for t in out.token_ids]

    async def run() -> list[list[int]]:
        loop = asyncio.create_task(engine.run())
        results = await asyncio.wait_for(asyncio.gather(*(collect(f"r{i}") for i in range(3))), 10)
        loop.cancel()
        return results

    with capture_logs() as logs:
        results = asyncio.run(run())
    assert results == [[7] * 12] * 3
    preempted = [entry for entry in logs if entry["event"] == "request preempted"]
    assert scheduler.num_preemptions > 0 and len(preempted) == scheduler.num_preemptions
    assert all(entry["log_level"] == "info" and entry["request_id"] in {"r0", "r1", "r2"} for entry in preempted)
    # Ids and sizes only: no text, no token ids of the request.
    assert all(set(entry) == {"event", "log_level", "request_id", "seq_id", "num_tokens", "num_preemptions",
                              "num_running", "num_free_blocks"} for entry in preempted), preempted
    assert all(isinstance(entry[key], int) for entry in preempted for key in ("num_tokens", "num_free_blocks"))
    exposed = generate_latest(metrics.registry).decode()
    assert f"tpserve:num_preemptions_total {float(scheduler.num_preemptions)}" in exposed


def test_a_worker_group_restart_is_not_a_preemption() -> None:
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    seen: list = []
    scheduler.on_preempt = seen.append
    seq = make_seq(0, PROMPT, 4)
    scheduler.add(seq)
    scheduler.schedule()
    assert scheduler.reset_workers() == 1 and seq.num_preemptions == 1 and seen == []
