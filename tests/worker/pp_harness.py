"""Run step plans through ``ModelRunner`` on ``tp x pp`` gloo groups (child-process side).

As tests/worker/tp_harness.py, with pipeline stages: ``tp * pp`` ranks, stage-major
(worker/pipeline.py); every rank executes every plan; the sampling rank (rank 0 of
the last stage) records what it sampled, and every other rank must sample nothing.
Several layouts run in one spawn of processes (each joins a fresh process group per
layout), which saves the start-up of a spawn per layout; the ranks fork from the tests' fork
server (tests/worker/rank_processes.py), which has imported torch already.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path

from tests.worker.rank_processes import spawn_ranks
from tests.worker.tp_harness import COLLECTIVE_TIMEOUT_S, Job, StepRecord, _free_port, execute_jobs, share_cores
from tpserve.pipeline_split import sampling_rank
from worker.parallel_state import destroy_distributed, init_distributed

#: A layout: (tensor_parallel_size, pipeline_parallel_size).
Layout = tuple[int, int]


def _layout_address(rank: int, layout_index: int, out_dir: str) -> str:
    """The layout's rendezvous address: rank 0 draws a free port when the layout starts and writes it to a file the
    other ranks wait for. Drawn then, not when the test planned the layouts: a port only noted as free for the
    tens of seconds the earlier layouts run could be bound meanwhile by another test's server."""
    path = Path(out_dir) / f"layout{layout_index}.address"
    if rank == 0:
        (Path(out_dir) / f"layout{layout_index}.tmp").write_text(f"tcp://127.0.0.1:{_free_port()}")
        os.rename(Path(out_dir) / f"layout{layout_index}.tmp", path)
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 gave no rendezvous address for layout {layout_index}")
        time.sleep(0.01)
    return path.read_text()


def _rank_main(rank: int, runs: list[tuple[Layout, list[Job]]], out_dir: str) -> None:
    share_cores()  # one thread, no spinning: ranks share the machine's cores
    for index, ((tp, pp), jobs) in enumerate(runs):
        if rank >= tp * pp:
            continue
        init_method = _layout_address(rank, index, out_dir)
        ctx = init_distributed(rank, tp, init_method, "cpu", COLLECTIVE_TIMEOUT_S, pp_size=pp)
        try:
            results = execute_jobs(ctx, jobs)
            ctx.pp.wait_sends()
            if rank != sampling_rank(tp, pp):
                for records in results.values():
                    assert all(r.sampled_token_ids == () and r.logits is None and not r.prompt_logprobs
                               for r in records)
            else:
                with open(Path(out_dir) / f"tp{tp}_pp{pp}.pkl", "wb") as f:
                    pickle.dump(results, f)
        finally:
            destroy_distributed()


def run_pipeline_layouts(runs: dict[Layout, list[Job]]) -> dict[Layout, dict[str, list[StepRecord]]]:
    """Run each layout's jobs on ``tp * pp`` CPU ranks; return each layout's sampling-rank records."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = list(runs.items())
        nprocs = max(tp * pp for tp, pp in runs)
        spawn_ranks(_rank_main, (plan, tmp), nprocs=nprocs)
        out = {}
        for tp, pp in runs:
            with open(Path(tmp) / f"tp{tp}_pp{pp}.pkl", "rb") as f:
                out[(tp, pp)] = pickle.load(f)
        return out
