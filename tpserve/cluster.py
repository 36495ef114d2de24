"""``tpserve serve``: one coordinator and its N worker-rank processes on this machine.

Start-up order:
  1. read the model's config.json and refuse a model that cannot be split at the
     asked tensor_parallel_size (before any process starts);
  2. bind the public gRPC port with the health service NOT_SERVING (so probes and
     clients get a clear UNAVAILABLE while the model loads);
  3. start the ranks (``python -m worker.main``), each on a unix socket, joined by a
     torch.distributed rendezvous on a free loopback port;
  4. wait until every rank has loaded its shard; size the KV pool to the smallest
     rank's budget; start the engine; health SERVING.
Shutdown (SIGINT, SIGTERM, or a rank's death): health NOT_SERVING, stop accepting,
finish in-flight RPCs within a grace period, stop every rank, leave no process behind.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.errors import ErrorInterceptor
from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler
from coordinator.server import GenerationServicer
from coordinator.tokenizer import Tokenizer
from coordinator.worker_client import WorkerGroup, WorkerGroupError
from tpserve.config import ClusterConfig
from tpserve.model_config import ModelConfig
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

log = structlog.get_logger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
#: Seconds in-flight RPCs get to finish on shutdown.
SHUTDOWN_GRACE_SECONDS = 5.0
#: Seconds a rank gets to exit after SIGTERM before SIGKILL.
WORKER_EXIT_SECONDS = 5.0


#: Name GetModelInfo reports for the embedded model (its model card's name).
DEFAULT_MODEL_NAME = "tpserve-tiny-stories"


def default_model_dir() -> Path:
    """The model embedded in the tpserve package (see tpserve/default_model/README.md)."""
    return Path(str(resources.files("tpserve") / "default_model"))


class StartupError(RuntimeError):
    """The cluster cannot start with this configuration or model; the message says why."""


class Cluster:
    """A coordinator with its worker ranks. ``await Cluster(config).serve()`` runs until stopped."""

    def __init__(self, config: ClusterConfig, log_format: str = "console") -> None:
        self.config = config
        self.log_format = log_format
        self.model_dir = Path(config.load.model) if config.load.model else default_model_dir()
        self.model_config = _read_model_config(self.model_dir, config.parallel.tensor_parallel_size)
        model_len = self.model_config.max_position_embeddings
        self.max_model_len = config.scheduler.max_model_len or model_len
        if self.max_model_len > model_len:
            raise StartupError(f"--max-model-len {self.max_model_len} exceeds the model's max_position_embeddings={model_len}")
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.health = health.aio.HealthServicer()
        self.metrics = Metrics()
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._procs: list[subprocess.Popen] = []
        self._socket_dir = Path(tempfile.mkdtemp(prefix="tpserve-"))
        self.engine: Engine | None = None
        self._dtype = ""  # resolved by the ranks
        self.port: int | None = None

    def stop(self, exit_code: int = 0) -> None:
        """Asks the cluster to shut down (safe from signal handlers and callbacks)."""
        self._exit_code = self._exit_code or exit_code
        self._stop.set()

    async def serve(self) -> int:
        """Runs until SIGINT/SIGTERM or a fatal error; returns the process exit code."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.stop)
        server = self._build_server()
        self.port = server.add_insecure_port(f"{self.config.server.host}:{self.config.server.port}")
        if self.port == 0:
            raise StartupError(f"cannot bind {self.config.server.host}:{self.config.server.port}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        log.info("listening", port=self.port, model=str(self.model_dir), tensor_parallel_size=self.world_size)
        if self.config.server.metrics_port is not None:
            start_http_server(self.config.server.metrics_port, registry=self.metrics.registry)
        workers = WorkerGroup([self._worker_address(r) for r in range(self.world_size)], self.config.server.step_timeout_seconds)
        engine_task = monitor_task = None
        try:
            self._start_workers()
            monitor_task = asyncio.create_task(self._monitor_workers())
            ready = asyncio.create_task(self._start_engine(workers))
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and ready.exception() is None:
                engine_task = asyncio.create_task(self.engine.run())
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
                log.info("serving", num_kv_blocks=workers.num_kv_blocks, max_model_len=self.max_model_len)
                await self._stop.wait()
            elif ready.done():
                log.error("start-up failed", error=str(ready.exception()))
                self._exit_code = 1
            else:
                ready.cancel()
        finally:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            if self.engine is not None:
                self.engine.draining = True
            await server.stop(SHUTDOWN_GRACE_SECONDS)
            for task in (engine_task, monitor_task):
                if task is not None:
                    task.cancel()
            await workers.close()
            self._stop_workers()
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            log.info("stopped", exit_code=self._exit_code)
        return self._exit_code

    @property
    def world_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    def _build_server(self) -> grpc.aio.Server:
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        self.servicer = GenerationServicer(None, self.tokenizer, self._model_info(0))
        generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return server

    async def _set_health(self, status: int) -> None:
        for service in ("", GENERATION_SERVICE):
            await self.health.set(service, status)

    def _model_info(self, num_kv_blocks: int) -> pb.ModelInfo:
        cfg = self.config
        return pb.ModelInfo(
            model_name=cfg.load.served_model_name or (self.model_dir.name if cfg.load.model else DEFAULT_MODEL_NAME),
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            tensor_parallel_size=self.world_size,
            dtype=self._dtype,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            num_kv_blocks=num_kv_blocks,
            block_size=cfg.cache.block_size,
        )

    async def _start_engine(self, workers: WorkerGroup) -> None:
        cfg = self.config
        available = await workers.wait_ready(cfg.server.worker_start_timeout_seconds)
        num_blocks = cfg.cache.num_gpu_blocks_override or available
        if num_blocks > available:
            raise WorkerGroupError(f"--num-gpu-blocks-override {num_blocks} exceeds the {available} blocks a rank can hold")
        await workers.start(num_blocks)
        self._dtype = workers.dtype
        scheduler = Scheduler(BlockAllocator(num_blocks, cfg.cache.block_size),
                              cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens)
        self.metrics.kv_cache_total_blocks.set(num_blocks)
        self.metrics.kv_cache_free_blocks.set(num_blocks)
        self.engine = Engine(scheduler, workers, self.tokenizer, self.max_model_len, cfg.scheduler.max_queue_len,
                             self.metrics, on_fatal=lambda reason: self.stop(1))
        self.servicer.engine = self.engine
        self.servicer.model_info = self._model_info(num_blocks)

    # -- worker processes --------------------------------------------------------------

    def _worker_address(self, rank: int) -> str:
        return f"unix://{self._socket_dir}/rank{rank}.sock"

    def _start_workers(self) -> None:
        cfg = self.config
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(self.world_size):
            cmd = [sys.executable, "-m", "worker.main", "--model", str(self.model_dir), "--rank", str(rank),
                   "--world-size", str(self.world_size), "--address", self._worker_address(rank),
                   "--init-method", init_method, "--device", cfg.load.device, "--dtype", cfg.load.dtype,
                   "--block-size", str(cfg.cache.block_size),
                   "--kv-cache-memory-bytes", str(cfg.cache.kv_cache_memory_bytes),
                   "--distributed-timeout-seconds", str(cfg.parallel.distributed_timeout_seconds),
                   "--log-format", self.log_format]
            self._procs.append(subprocess.Popen(cmd))

    async def _monitor_workers(self) -> None:
        while True:
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    log.error("worker rank exited", rank=rank, returncode=proc.returncode)
                    if self.engine is not None and not self.engine.dead:
                        self.engine.fail_all(f"rank {rank} exited with code {proc.returncode}")
                    self.stop(1)
                    return
            await asyncio.sleep(0.5)

    def _stop_workers(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(WORKER_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _read_model_config(model_dir: Path, tensor_parallel_size: int) -> ModelConfig:
    if not (model_dir / "config.json").is_file():
        raise StartupError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        config = ModelConfig.from_pretrained(model_dir)
        config.check_tensor_parallel(tensor_parallel_size)
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir} at --tensor-parallel-size {tensor_parallel_size}: {exc}") from exc
    return config


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
