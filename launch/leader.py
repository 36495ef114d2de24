"""``tpserve serve``: one coordinator and its worker ranks, on one host or as the leader of several.

Start-up order:
  1. read the model's config.json and refuse a model that cannot be split at the
     asked tensor_parallel_size (before any process starts; :mod:`launch.startup`);
  2. bind the public gRPC port with the health service NOT_SERVING (:mod:`launch.public_server`);
  3. gather the group and start this host's ranks (:mod:`launch.group_launcher`: the node
     registry with ``--nnodes``, then ``python -m worker.main`` per local rank);
  4. wait until every rank of every host has loaded its shard; size the KV pool to
     the smallest rank's budget; start the engine; health SERVING.
A lost rank or node restarts the group (:mod:`launch.recovery`); SIGINT, SIGTERM or a failure
stops it in order (:mod:`launch.shutdown`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog

from coordinator.block_allocator import BlockAllocator, check_pool_holds_a_full_sequence
from coordinator import tracing
from coordinator.engine import Engine
from coordinator.errors import TpserveError
from coordinator.kv_host_tier import HostTier, num_host_slots
from coordinator.metrics import Metrics
from coordinator.ngram_proposer import make_proposer
from coordinator.scheduler import Scheduler
from coordinator.state_slots import hybrid_state_slots
from coordinator.tokenizer import Tokenizer
from coordinator.worker_client import WorkerGroupError
from launch.group_launcher import GroupLauncher
from launch.public_server import PublicServer
from launch.recovery import Recovery
from launch.shutdown import Shutdown
from launch.startup import (StartupError, check_hybrid_combinations, check_kv_side_channel, model_dir_of, read_group_secret,
                            read_model_config)
from launch.topology import GroupLayout
from tpserve.config import ClusterConfig
from tpserve.kv_wire import new_control_key
from tpserve.sched_policy import set_policy

log = structlog.get_logger(__name__)


def coordinator_has_a_core(num_threads: Mapping[int, int], local_ranks: Iterable[int], cores: int | None = None) -> bool:
    """Whether the CPU ranks on the coordinator's host leave it a core of its own: their intra-op
    threads (``num_threads``, rank -> threads, as the ranks report them) add up to fewer than the
    ``cores`` this process may run on (default: ``os.sched_getaffinity``). The default thread split
    (worker/server.py: the cores over the host's ranks) takes them all; ``OMP_NUM_THREADS`` can leave one.
    """
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return sum(num_threads.get(rank, 0) for rank in local_ranks) < cores


class Leader:
    """A coordinator with its worker ranks. ``await Leader(config).serve()`` runs until stopped.

    With ``--nnodes M > 1`` this is node 0 of a group whose other hosts run
    :class:`launch.headless.HeadlessNode`.

    Raises:
        StartupError: the model cannot be served with this configuration.
    """

    def __init__(self, config: ClusterConfig, log_format: str = "console") -> None:
        self.config = config
        self.model_dir = model_dir_of(config)
        self.model_config = read_model_config(self.model_dir, config.parallel.tensor_parallel_size,
                                              config.parallel.pipeline_parallel_size,
                                              config.parallel.enable_expert_parallel,
                                              quantization=config.load.quantization)
        check_hybrid_combinations(self.model_dir, self.model_config, config)
        if config.speculative.speculative_model is not None:
            draft = read_model_config(Path(config.speculative.speculative_model),
                                      config.parallel.tensor_parallel_size,
                                      enable_expert_parallel=config.parallel.enable_expert_parallel, draft=True)
            if draft.vocab_size != self.model_config.vocab_size:
                raise StartupError(f"--speculative-model {config.speculative.speculative_model} has vocab_size="
                                   f"{draft.vocab_size}, the model {self.model_config.vocab_size}: a draft model "
                                   "must share the model's tokenizer")
        model_len = self.model_config.max_model_len  # max_position_embeddings, or as RoPE scaling extends it
        self.max_model_len = config.scheduler.max_model_len or model_len
        if self.max_model_len > model_len:
            raise StartupError(f"--max-model-len {self.max_model_len} exceeds the model's longest context {model_len} "
                               f"(max_position_embeddings={self.model_config.max_position_embeddings}, "
                               "extended by dynamic or yarn RoPE scaling)")
        if config.server.otlp_traces_endpoint:  # before the model loads: a missing extra fails at once
            try:
                tracing.configure(config.server.otlp_traces_endpoint, "tpserve")
            except tracing.TracingUnavailableError as exc:
                raise StartupError(str(exc)) from None
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.metrics = Metrics()
        if tracing.enabled():  # every 16th step's timings become events on the request spans
            tracing.sample_steps(self.metrics)
        self.layout = GroupLayout(config.parallel.world_size, config.parallel.nnodes, 0)
        self.shutdown = Shutdown()
        self.public = PublicServer(config, self.model_dir, self.model_config, self.max_model_len, self.tokenizer,
                                   self.metrics)
        # Hold, release and pull come only from this coordinator: its ranks' KV agents require a key made here,
        # for this launch, that nothing else has (tpserve/kv_wire.py), whatever the cluster secret.
        kv_control_key = new_control_key() if config.kv_transfer.kv_transfer_config is not None else None
        self.public.kv_control_key = kv_control_key
        self.launcher = GroupLauncher(config, self.model_dir, self.layout, read_group_secret(config),
                                      self.max_model_len, log_format, on_lost=self._group_failed,
                                      kv_control_key=kv_control_key)
        self.recovery = Recovery(config, self.launcher, self.public, self.metrics, self.shutdown)
        self.engine: Engine | None = None

    def stop(self, exit_code: int = 0) -> None:
        """Asks the leader to shut down (safe from signal handlers and callbacks)."""
        self.shutdown.stop(exit_code)

    async def serve(self) -> int:
        """Runs until SIGINT/SIGTERM or a fatal error; returns the process exit code.

        Raises:
            StartupError: the public port, /metrics, TLS files or API keys cannot be used.
        """
        # The coordinator's wakeups must not preempt its own event loop (tpserve/sched_policy.py); the
        # ranks started below inherit the policy and reset themselves to SCHED_OTHER (worker/main.py).
        set_policy("batch")
        self.shutdown.install_signal_handlers(reload=self.public.reload)
        await self.public.start(self.layout.nnodes)
        check_kv_side_channel(self.config, self.layout.node_ranks())
        engine_task = None
        try:
            ready = asyncio.create_task(self._start_group())
            stopped = asyncio.create_task(self.shutdown.wait())
            await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and ready.exception() is None:
                engine_task = asyncio.create_task(self.engine.run())
                await self.public.set_serving(True)
                log.info("serving", **self.public.serving_fields(self.layout.nnodes))
                await self.shutdown.wait()
            elif ready.done():
                log.error("start-up failed", error=str(ready.exception()))
                self.shutdown.exit_code = 1
            else:
                ready.cancel()
        finally:
            await self.shutdown.drain(self.public, self.engine, self.config.server.shutdown_grace_seconds,
                                      [engine_task, *self.recovery.tasks], self.launcher)
            tracing.shutdown()  # the spans still batched go out
        return self.shutdown.exit_code

    async def _start_group(self) -> None:
        """Gathers the group, starts this host's ranks, waits for every rank, starts the engine."""
        cfg = self.config
        deadline = time.monotonic() + cfg.server.worker_start_timeout_seconds
        available = await self.launcher.start(deadline)
        num_state_slots = self.launcher.workers.num_state_slots_available  # hybrids: live + checkpoint slots
        num_blocks = cfg.cache.num_gpu_blocks_override or available
        if num_blocks > available:
            raise WorkerGroupError(f"--num-gpu-blocks-override {num_blocks} exceeds the {available} blocks a rank can hold")
        check_pool_holds_a_full_sequence(num_blocks, cfg.cache.block_size, self.max_model_len)
        workers = self.launcher.workers
        num_host_blocks = num_host_slots(cfg.cache.kv_offloading_size, cfg.cache.num_cpu_blocks_override,
                                         list(workers.kv_bytes_per_block.values()))
        await workers.start(num_blocks, num_state_slots, num_host_blocks)
        self.engine = self._build_engine(num_blocks, num_state_slots, num_host_blocks)
        self.public.attach(self.engine, num_blocks, workers.dtype)
        self.recovery.engine = self.engine
        self.recovery.watch_liveness()

    def _build_engine(self, num_blocks: int, num_state_slots: int = 0, num_host_blocks: int = 0) -> Engine:
        """The scheduler over a pool of ``num_blocks`` KV blocks (a hybrid's ``num_state_slots``, a host tier
        of ``num_host_blocks``), and the engine that runs it."""
        cfg = self.config
        workers = self.launcher.workers
        spare_core = workers.device == "cpu" and coordinator_has_a_core(workers.num_threads, self.layout.node_ranks())
        # Dynamic NTK RoPE rotates a prompt's keys for the prompt's length once that passes max_position_embeddings
        # (worker/layers/rotary.py): equal prefixes of different prompts need not hold equal keys, so none are shared.
        scaling = self.model_config.rope_scaling or {}
        share_prefixes = cfg.cache.enable_prefix_caching and not (
            scaling.get("rope_type") == "dynamic" and self.max_model_len > self.model_config.max_position_embeddings)
        try:
            state_slots = hybrid_state_slots(self.model_config, cfg.scheduler.max_num_seqs, num_state_slots)
        except ValueError as exc:
            raise WorkerGroupError(str(exc)) from None
        if state_slots is not None:  # what fits: sequences' states, prefix checkpoints, KV tokens
            log.info("state cache", num_live_state_slots=state_slots.num_live,
                     num_checkpoint_state_slots=state_slots.num_checkpoints,
                     kv_cache_tokens=num_blocks * cfg.cache.block_size)
            if share_prefixes and not state_slots.num_checkpoints:  # a hit resumes from a saved state: none fits
                log.warning("prefix caching finds no hit: the cache holds no state checkpoint for this hybrid "
                            "model; give the cache more memory (a small --num-gpu-blocks-override sizes them too)")
        host_tier = HostTier(num_host_blocks, cfg.cache.block_size) if num_host_blocks and share_prefixes else None
        if num_host_blocks and host_tier is None:
            log.warning("kv host tier off: this model's dynamic RoPE shares no prefix", blocks=num_host_blocks)
        scheduler = Scheduler(BlockAllocator(num_blocks, cfg.cache.block_size),
                              cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
                              enable_prefix_caching=share_prefixes,
                              proposer=make_proposer(cfg.speculative),
                              disable_speculation_above=cfg.speculative.speculative_disable_by_batch_size,
                              async_scheduling=cfg.async_scheduling_on(workers.device, spare_core),
                              priority_aging_s=cfg.scheduler.priority_aging_seconds, state_slots=state_slots,
                              host_tier=host_tier, num_scheduler_steps=cfg.scheduler.num_scheduler_steps)
        self.metrics.set_pool(num_blocks, cfg.cache.block_size, cfg.scheduler.max_num_seqs)
        if host_tier is not None:
            self.metrics.kv_offload.configure(num_host_blocks, sum(workers.kv_bytes_per_block.values()))
        return Engine(scheduler, self.launcher.workers, self.tokenizer, self.max_model_len,
                      cfg.scheduler.max_queue_len, self.metrics, on_fatal=lambda reason: self.stop(1),
                      on_group_failure=self._group_failed, micro_batches=cfg.parallel.pipeline_parallel_size,
                      stream_interval=cfg.server.stream_interval)

    def _group_failed(self, reason: str, error: type[TpserveError] = TpserveError) -> bool:
        """A rank or a node is lost: restart the group or stop (:meth:`launch.recovery.Recovery.group_failed`)."""
        return self.recovery.group_failed(reason, error)
