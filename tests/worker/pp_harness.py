"""Run step plans through ``ModelRunner`` on a ``tp x pp`` gloo group (child-process side).

As tests/worker/tp_harness.py, with pipeline stages: ``tp * pp`` ranks, stage-major
(worker/pipeline.py); every rank executes every plan; the sampling rank (rank 0 of
the last stage) records what it sampled, and every other rank must sample nothing.
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.worker.tp_harness import COLLECTIVE_TIMEOUT_S, Job, StepRecord, _free_port, execute_jobs
from tpserve.pipeline_split import sampling_rank
from worker.parallel_state import destroy_distributed, init_distributed


def _rank_main(rank: int, tp: int, pp: int, init_method: str, jobs: list[Job], out_path: str) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    ctx = init_distributed(rank, tp * pp, init_method, "cpu", COLLECTIVE_TIMEOUT_S, pipeline_parallel_size=pp)
    try:
        results = execute_jobs(ctx, jobs)
        ctx.pp.wait_sends()
        if rank != sampling_rank(tp, pp):
            for records in results.values():
                assert all(r.sampled_token_ids == () and r.logits is None and not r.prompt_logprobs
                           for r in records)
        else:
            with open(out_path, "wb") as f:
                pickle.dump(results, f)
    finally:
        destroy_distributed()


def run_pipeline_jobs(jobs: list[Job], tp: int, pp: int) -> dict[str, list[StepRecord]]:
    """Run ``jobs`` on ``tp * pp`` spawned CPU ranks; return the sampling rank's records."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "sampler.pkl")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        mp.spawn(_rank_main, args=(tp, pp, init_method, jobs, out_path), nprocs=tp * pp, join=True)
        with open(out_path, "rb") as f:
            return pickle.load(f)
