"""Run step plans through ``ModelRunner`` on every rank of a gloo group (child-process side).

The parent (a test) prepares :class:`Job` s — a checkpoint and the plans to feed
it — and calls :func:`run_jobs`; each rank builds its runner and executes the
same plans; rank 0 records, per step, the sampled tokens and the logits it
sampled from. Several jobs share one process group to amortise start-up.
This module imports no ``transformers``: spawned ranks import only the worker.
"""

from __future__ import annotations

import dataclasses
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.e2e.cluster import free_port
from tests.worker.rank_processes import spawn_ranks
from tpserve.step import PromptLogprobs, StepPlan
from worker.kernels import cpu_kernels_available
from worker.lora_settings import LoRASettings
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext, destroy_distributed, init_distributed

#: Seconds a collective may wait before the test fails instead of hanging.
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Job:
    """One checkpoint and the plans to run on it."""

    name: str
    model_dir: str
    plans: tuple[StepPlan, ...]
    num_blocks: int
    block_size: int
    dtype: torch.dtype = torch.float32
    quantization: str | None = None
    cuda_graph_sizes: tuple[int, ...] = ()  # decode graphs (worker/cuda_graphs.py); off CUDA run uncaptured
    max_model_len: int | None = None
    enable_expert_parallel: bool = False  # whole experts per rank (worker/layers/moe.py)
    triton_experts: bool = False  # the CUDA path's grouped Triton experts (off CUDA: Triton's interpreter)
    lora: LoRASettings | None = None  # --enable-lora's slots and adapters (worker/lora_adapters.py)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (worker/kv_quant.py)
    decode_region: bool = True  # False: torch.ops.tpserve_cpu.use_decode_region(False) while the job runs


@dataclass(frozen=True)
class StepRecord:
    """What rank 0 saw for one step."""

    sampled_token_ids: tuple[int, ...]
    logits: torch.Tensor | None  # (num_samples, vocab_size) float32
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    expert_token_counts: tuple[int, ...] = ()  # (layer, expert, num_tokens) triples, MoE models
    decode_region_steps: int = 0  # steps this rank ran in the CPU decode region (worker/kernels/cpu_decode_region.cpp)


def execute_jobs(ctx: ParallelContext, jobs: list[Job]) -> dict[str, list[StepRecord]]:
    """Run every job on this rank; returns the records (meaningful on rank 0)."""
    from worker.layers import moe

    results: dict[str, list[StepRecord]] = {}
    torch_experts = moe.grouped_experts
    for job in jobs:
        if job.triton_experts:
            from worker.kernels.triton_moe import grouped_experts_triton

            moe.grouped_experts = grouped_experts_triton  # type: ignore[assignment]
        try:
            results[job.name] = _execute_job(ctx, job)
        finally:
            moe.grouped_experts = torch_experts
    return results


def _execute_job(ctx: ParallelContext, job: Job) -> list[StepRecord]:
    """One job's plans through a fresh runner; each step's record."""
    job_ctx = dataclasses.replace(ctx, enable_expert_parallel=job.enable_expert_parallel)
    runner = ModelRunner(job.model_dir, job_ctx, job.dtype, job.block_size, quantization=job.quantization,
                         lora=job.lora, kv_cache_dtype=job.kv_cache_dtype)
    runner.init_kv_cache(job.num_blocks, cuda_graph_sizes=job.cuda_graph_sizes, max_model_len=job.max_model_len,
                         capture=ctx.device.type == "cuda")
    ops = torch.ops.tpserve_cpu if cpu_kernels_available() else None
    if ops is not None:
        ops.use_decode_region(job.decode_region)
    records = []
    try:
        for plan in job.plans:
            region_steps = ops.decode_region_steps() if ops is not None else 0
            result = runner.execute(plan)
            assert result.step_id == plan.step_id
            logits = None if runner.last_logits is None else runner.last_logits.cpu().clone()
            region_steps = (ops.decode_region_steps() if ops is not None else 0) - region_steps
            records.append(StepRecord(result.sampled_token_ids, logits, result.prompt_logprobs,
                                      result.expert_token_counts, region_steps))
    finally:
        if ops is not None:
            ops.use_decode_region(True)
    return records


def share_cores() -> None:
    """A test rank's settings for a machine whose cores its peers (and other tests) share.

    One torch thread per rank. And a shared-memory collective sleeps on a late peer's flag at
    once instead of first spinning for it (worker/comm/shm_allreduce.py's ``_SPIN_S``, 200 us):
    the spin pays off when each rank has a core of its own, as a server's ranks do, but the
    tests run 2 to 4 ranks on 2 busy cores, where the peer is usually descheduled and every
    spin burns CPU the others need (the families at tp 4: about 2x the ranks' CPU seconds).
    The collective still polls its peers' flags before it sleeps (worker/kernels/cpu_shm.cpp),
    so both of its paths (the peer already there, and the sleep and wake) still run.
    """
    from worker.comm import shm_allreduce

    torch.set_num_threads(1)
    shm_allreduce._SPIN_S = 0.0


def _rank_main(rank: int, tp_size: int, init_method: str, jobs: list[Job], out_path: str,
               device: str = "cpu") -> None:
    share_cores()
    device = "cpu" if device == "cpu" else f"cuda:{rank}"  # one GPU per rank (NCCL), else gloo
    ctx = init_distributed(rank, tp_size, init_method, device, COLLECTIVE_TIMEOUT_S)
    try:
        results = execute_jobs(ctx, jobs)
        if rank != 0:
            for records in results.values():
                assert all(r.sampled_token_ids == () and r.logits is None and not r.prompt_logprobs
                           and not r.expert_token_counts for r in records)
        else:
            with open(out_path, "wb") as f:
                pickle.dump(results, f)
    finally:
        destroy_distributed()


def _free_port() -> int:
    return free_port()  # outside the ephemeral range (tests/e2e/cluster.py)


def run_jobs(jobs: list[Job], tp_size: int, device: str = "cpu") -> dict[str, list[StepRecord]]:
    """Run ``jobs`` at tensor-parallel degree ``tp_size``; return rank 0's records (logits on the CPU).

    ``tp_size == 1`` runs in this process (no process group is needed);
    larger degrees start one process per rank (tests/worker/rank_processes.py), joined over gloo on localhost
    (``device="cpu"``) or NCCL with rank ``r`` on ``cuda:r`` (``device="cuda"``).
    """
    if tp_size == 1:
        return execute_jobs(ParallelContext.single("cuda:0" if device == "cuda" else device), jobs)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "rank0.pkl")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        spawn_ranks(_rank_main, (tp_size, init_method, jobs, out_path, device), nprocs=tp_size)
        with open(out_path, "rb") as f:
            return pickle.load(f)


def _lost_rank_main(rank: int, tp_size: int, init_method: str, timeout_s: float, out_path: str) -> None:
    """Rank 1 stops taking part (hung, still connected); rank 0 records how its next all-reduce ends."""
    import os
    import time

    ctx = init_distributed(rank, tp_size, init_method, "cpu", timeout_s)
    ctx.all_reduce(torch.ones(4))  # the group works
    if rank == 1:
        # Hung: the connection stays open, nothing is sent, until rank 0 has its outcome (or long past its timeout).
        deadline = time.monotonic() + timeout_s + 1.0
        while not os.path.exists(out_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    start = time.monotonic()
    try:
        ctx.all_reduce(torch.ones(4))
        outcome = "returned"
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(error).__name__}: {error}"
    with open(out_path, "wb") as f:
        pickle.dump((outcome, time.monotonic() - start), f)
    os._exit(0)  # skip destroy_process_group, which would wait for the lost peer


def run_lost_rank(timeout_s: float) -> tuple[str, float]:
    """Start 2 ranks, hang rank 1, return rank 0's all-reduce outcome and the seconds it took."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "rank0.pkl")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        spawn_ranks(_lost_rank_main, (2, init_method, timeout_s, out_path), nprocs=2)
        with open(out_path, "rb") as f:
            return pickle.load(f)
