"""This host's worker-rank processes: start them, watch them, stop them.

Used by the leader (:mod:`tpserve.cluster`) and by a headless node
(:mod:`tpserve.headless`). Each rank is ``python -m worker.main`` with its global
rank, its place on this host (``--local-rank``, ``--local-world-size``,
``--node-rank``: a rank's same-host peers are global ranks ``node_rank *
local_world_size + [0, local_world_size)``), the address its WorkerService binds
and the group's torch.distributed rendezvous. No torch.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import structlog

from tpserve.cluster_secret import ENV_VAR, read_secret
from tpserve.config import ClusterConfig
from tpserve.topology import GroupLayout

log = structlog.get_logger(__name__)

#: Seconds a rank gets to exit after SIGTERM before SIGKILL.
WORKER_EXIT_SECONDS = 5.0
#: Seconds between checks that every rank still runs.
POLL_SECONDS = 0.5


class LocalRanks:
    """The ranks of one node of a group.

    Args:
        config: the cluster configuration (model, dtype, cache and timeout flags).
        model_dir: the checkpoint directory.
        layout: the group's placement; this node is ``layout.node_rank``.
        log_format: "console" or "json", passed to the ranks.
    """

    def __init__(self, config: ClusterConfig, model_dir: Path, layout: GroupLayout, log_format: str) -> None:
        self.config = config
        self.model_dir = model_dir
        self.layout = layout
        self.log_format = log_format
        self.procs: dict[int, subprocess.Popen] = {}  # global rank -> process

    def start(self, addresses: Mapping[int, str], init_method: str, interface: str | None = None) -> None:
        """Starts one process per local rank.

        Args:
            addresses: global rank -> the gRPC address its WorkerService binds.
            init_method: torch.distributed rendezvous, e.g. ``tcp://10.0.0.7:29501``.
            interface: the network interface the group's collectives use across hosts
                (gloo and NCCL otherwise pick one from the host name, which can be a
                loopback address); an explicit ``GLOO_SOCKET_IFNAME`` /
                ``NCCL_SOCKET_IFNAME`` in the environment wins.
        """
        env = dict(os.environ)
        if self.config.parallel.cluster_secret_file:
            # In the environment, not on the command line (which any user of the host can read).
            env[ENV_VAR] = read_secret(self.config.parallel.cluster_secret_file)
        if interface is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
        for rank in self.layout.node_ranks():
            # A session of their own: Ctrl-C in a terminal, or SIGINT/SIGTERM to the
            # coordinator's process group (a container runtime, ``kill -- -PGID``), must
            # reach the coordinator only, which drains in-flight requests and then stops
            # the ranks (issue 11, fault 4). A rank still exits when its parent dies
            # (worker/main.py watches it).
            self.procs[rank] = subprocess.Popen(self._command(rank, addresses[rank], init_method), env=env,
                                                start_new_session=True)
        log.info("ranks started", node_rank=self.layout.node_rank, ranks=list(self.procs),
                 init_method=init_method, interface=interface)

    def _command(self, rank: int, address: str, init_method: str) -> list[str]:
        cfg, layout = self.config, self.layout
        return [sys.executable, "-m", "worker.main", "--model", str(self.model_dir),
                "--rank", str(rank), "--world-size", str(layout.world_size),
                "--pipeline-parallel-size", str(cfg.parallel.pipeline_parallel_size),
                "--local-rank", str(layout.local_rank(rank)), "--local-world-size", str(layout.ranks_per_node),
                "--node-rank", str(layout.node_rank),
                "--address", address, "--init-method", init_method,
                "--device", cfg.load.device, "--dtype", cfg.load.dtype,
                *(["--quantization", cfg.load.quantization] if cfg.load.quantization else []),
                *(["--enforce-eager"] if cfg.load.enforce_eager else []),
                *(["--cuda-graph-sizes", *map(str, cfg.load.cuda_graph_sizes)] if cfg.load.cuda_graph_sizes else []),
                "--block-size", str(cfg.cache.block_size),
                *cfg.worker_cache_flags(),
                "--distributed-timeout-seconds", str(cfg.parallel.distributed_timeout_seconds),
                "--log-format", self.log_format]

    def first_exited(self) -> tuple[int, int] | None:
        """(global rank, exit code) of a rank that has exited, or None while all run."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return rank, proc.returncode
        return None

    async def wait_first_exit(self) -> tuple[int, int]:
        """Returns (global rank, exit code) as soon as any rank exits."""
        while (exited := self.first_exited()) is None:
            await asyncio.sleep(POLL_SECONDS)
        return exited

    def stop(self) -> None:
        """SIGTERM every rank, SIGKILL those still running after WORKER_EXIT_SECONDS."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(WORKER_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
