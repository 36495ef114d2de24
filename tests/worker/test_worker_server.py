"""A rank's gRPC service with ``torch.cuda`` mocked: its GPU, its KV cache size, its stepping thread.

The rank is local rank 1 of 2 on a host with 2 fake GPUs. The real
``WorkerServicer`` loads (through a stand-in model runner that records which
thread calls it and what that thread's current CUDA device is), sizes its KV
cache from the fake GPU's memory after the profiling steps, and serves ``Step``
over a real gRPC server, whose pool thread must set the device itself.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from tests.worker.cuda_mock import GIB, FakeCuda
from tpserve.embedded_model import default_model_dir
from tpserve.model_config import ModelConfig
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan, StepResult
from tpserve.step_pb import ERRORS_ONLY, STEP_PROTOCOL, plan_to_pb, result_from_pb
from tpserve.v1 import worker_pb2 as pb
from tpserve.v1 import worker_pb2_grpc
from worker.kv_cache import KVCacheLayout
from worker.memory import CacheSizing, profile_plans
from worker.parallel_state import ParallelContext
from worker.server import WorkerOptions, WorkerServicer

SIZING = CacheSizing(gpu_memory_utilization=0.9, max_num_batched_tokens=64, max_num_seqs=4)


class FakeRunner:
    """Records, per call, the thread and its current CUDA device; computes nothing."""

    def __init__(self, cuda: FakeCuda, model_dir: str, ctx: ParallelContext, dtype: torch.dtype, block_size: int,
                 quantization: str | None = None, draft_model_dir: str | None = None, kv_cache_dtype: str = "auto",
                 lora: object = None):
        self.cuda = cuda
        self.kv_cache_dtype = dtype
        self.model = torch.nn.Module()  # no weights: what the rank logs about them (weight_bytes) is 0
        self.model.quantization = quantization
        self.config = ModelConfig.from_pretrained(model_dir)
        self.ctx = ctx
        self.kv_layout = KVCacheLayout.for_model(self.config, ctx.tp_size, block_size, dtype)
        self.state_bytes_per_slot = 0  # an attention-only model: no state pool
        self.calls: list[tuple[str, str, torch.device | None]] = []  # (method, thread name, current device)

    def _record(self, method: str) -> None:
        self.calls.append((method, threading.current_thread().name, self.cuda.current_device()))

    def init_kv_cache(self, num_blocks: int, cuda_graph_sizes: tuple[int, ...] = (),
                      max_model_len: int | None = None, num_state_slots: int | None = None,
                      num_host_blocks: int = 0) -> None:
        self._record("init_kv_cache")
        self.cuda_graph_sizes = tuple(cuda_graph_sizes)  # captured as asked: no model, nothing to refuse
        self.num_host_blocks = num_host_blocks
        self.host_tier = None  # the real runner's slots (worker/kv_host_tier.py); none here

    def free_kv_cache(self) -> None:
        self._record("free_kv_cache")

    def execute(self, plan: StepPlan) -> StepResult:
        self._record("execute")
        return StepResult(plan.step_id, tuple(7 for chunk in plan.scheduled if chunk.sample))


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerServicer, FakeCuda, list[FakeRunner]]:
    cuda = FakeCuda(num_gpus=2).install(monkeypatch)
    runners: list[FakeRunner] = []

    def make_runner(*args, **kwargs) -> FakeRunner:
        runners.append(FakeRunner(cuda, *args, **kwargs))
        return runners[-1]

    monkeypatch.setattr("worker.model_runner.ModelRunner", make_runner)
    monkeypatch.setattr("worker.parallel_state.init_distributed",
                        lambda rank, tp_size, init_method, device, timeout, **_: ParallelContext(rank, tp_size, device))
    monkeypatch.setattr("worker.nccl_env.configure_nccl_env", lambda: {})
    options = WorkerOptions(
        model_dir=str(default_model_dir()), rank=1, tensor_parallel_size=2, init_method="tcp://127.0.0.1:1", device="cuda",
        dtype="bfloat16", block_size=16, distributed_timeout_seconds=10.0, local_rank=1, local_world_size=2,
        cache=SIZING)
    errors: list[str] = []
    servicer = WorkerServicer(options, errors.append)
    loader = threading.Thread(target=servicer.load, name="load")
    loader.start()
    loader.join()
    assert errors == [] and servicer._ready.is_set()
    return servicer, cuda, runners


def test_load_binds_the_local_gpu_and_sizes_the_cache_from_free_memory(loaded) -> None:
    servicer, cuda, (runner,) = loaded
    assert cuda.set_device_calls[0] == ("load", torch.device("cuda", 1))
    assert runner.ctx.device == torch.device("cuda", 1)
    # The profile ran the scheduler's largest steps on the load thread, on cuda:1, then freed its cache.
    num_profile_blocks, plans = profile_plans(64, 4, runner.config.max_position_embeddings, 16)
    assert [c[0] for c in runner.calls] == ["init_kv_cache", "execute", "execute", "execute", "free_kv_cache"]
    assert all(thread == "load" and device == torch.device("cuda", 1) for _, thread, device in runner.calls)
    assert cuda.events.index("reset_peak_memory_stats") < cuda.events.index("mem_get_info")
    # vLLM's rule: 0.9 * total - (peak activations and weights + memory outside torch's allocator).
    profile_bytes = num_profile_blocks * runner.kv_layout.bytes_per_block
    used = (cuda.peak - profile_bytes) + (cuda.total - cuda.free - cuda.reserved)
    expected_blocks = (int(0.9 * 80 * GIB) - used) // runner.kv_layout.bytes_per_block
    status = servicer.GetStatus(pb.GetStatusRequest(), None)
    assert status.ready and status.num_kv_blocks_available == expected_blocks > 0
    assert status.step_protocol == STEP_PROTOCOL == 5  # what the coordinator checks before the first step
    assert status.kv_bytes_per_block == runner.kv_layout.bytes_per_block > 0  # sizes the host tier


def test_init_cache_and_step_bind_the_ranks_gpu_in_the_threads_that_run_them(loaded, tmp_path: Path) -> None:
    servicer, cuda, (runner,) = loaded
    runner.calls.clear()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-pool"))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    address = f"unix://{tmp_path}/rank1.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            # InitCache called from a thread of its own, so that no pool thread has set a device before Step.
            init = threading.Thread(target=servicer.InitCache, args=(pb.InitCacheRequest(num_kv_blocks=8), None),
                                    name="init-cache")
            init.start()
            init.join()
            plans = [StepPlan(0, (NewSequence(0, SamplingParams(0.0)),), (ScheduledChunk(0, (1, 2), 0, (0,)),)),
                     StepPlan(1, scheduled=(ScheduledChunk(0, (3,), 2),))]
            results = [result_from_pb(r) for r in stub.Step(iter(plan_to_pb(p) for p in plans), timeout=10)]
    finally:
        server.stop(grace=None)
    assert [r.sampled_token_ids for r in results] == [(7,), (7,)]
    assert runner.calls[0] == ("init_kv_cache", "init-cache-rank1_0", torch.device("cuda", 1))
    # ...on a thread that has ended, so that its OpenMP team is gone before the steps run.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("init-cache-rank")]
    assert runner.cuda_graph_sizes == (1, 2, 4)  # vLLM's sizes up to max_num_seqs=4 (the default, no flag)
    assert [c[0] for c in runner.calls[1:]] == ["execute", "execute"]
    for method, thread, device in runner.calls[1:]:
        assert thread.startswith("grpc-pool"), (method, thread)  # a gRPC handler thread, not the load thread
        assert device == torch.device("cuda", 1), (method, thread, device)  # bound in that very thread


def test_a_stream_opened_errors_only_is_answered_only_for_the_step_that_fails(loaded, tmp_path: Path) -> None:
    """Every rank but the sampling rank (coordinator/worker_client.py): one answer, the failure."""
    servicer, _, (runner,) = loaded
    plain, executed = runner.execute, []

    def execute(plan: StepPlan) -> StepResult:
        executed.append(plan.step_id)
        if plan.step_id == 2:
            raise RuntimeError("boom")
        return plain(plan)

    runner.execute = execute
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    address = f"unix://{tmp_path}/rank1.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        servicer.InitCache(pb.InitCacheRequest(num_kv_blocks=8), None)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            plans = [StepPlan(i) for i in range(4)]
            answers = list(stub.Step(iter(plan_to_pb(p) for p in plans), timeout=10, metadata=(ERRORS_ONLY,)))
            plain_answers = list(stub.Step(iter(plan_to_pb(p) for p in plans[:2]), timeout=10))
    finally:
        server.stop(grace=None)
    assert [(a.step_id, a.error) for a in answers] == [(2, "rank 1: step 2 failed: RuntimeError: boom")]
    assert [a.step_id for a in plain_answers] == [0, 1] and not any(a.error for a in plain_answers)
    assert executed == [0, 1, 2, 0, 1]  # the first stream ended at its failure


def test_init_cache_captures_the_flags_graph_sizes_or_none_with_enforce_eager(loaded) -> None:
    servicer, _, (runner,) = loaded
    for changes, expected in (({"cuda_graph_sizes": (1, 8)}, (1, 8)), ({"enforce_eager": True}, ())):
        servicer.options = replace(servicer.options, **changes)
        servicer.InitCache(pb.InitCacheRequest(num_kv_blocks=8), None)
        assert runner.cuda_graph_sizes == expected and runner.num_host_blocks == 0
    servicer.InitCache(pb.InitCacheRequest(num_kv_blocks=8, num_host_blocks=80), None)  # --kv-offloading-size
    assert runner.num_host_blocks == 80


def test_step_reports_its_execute_time_and_the_wait_for_its_plan(loaded) -> None:
    """Rank 0's timing in StepResult (tpserve:model_execute_time_seconds, tpserve:worker_wait_seconds)."""
    import time

    servicer, _, (runner,) = loaded
    plain = runner.execute

    def slow_execute(plan: StepPlan) -> StepResult:
        time.sleep(0.02)
        return plain(plan)

    runner.execute = slow_execute

    def plans():
        yield plan_to_pb(StepPlan(0))
        time.sleep(0.05)  # the coordinator takes its time to send the next plan
        yield plan_to_pb(StepPlan(1))

    first, second = (result_from_pb(r) for r in servicer.Step(plans(), None))
    assert 0.02 <= first.model_execute_time_s < 1 and 0.02 <= second.model_execute_time_s < 1
    assert first.wait_time_s == 0.0  # nothing was sent before it
    assert 0.05 <= second.wait_time_s < 1
