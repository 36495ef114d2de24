"""This host's worker-rank processes: start them, watch them, stop them.

Used by the leader (:mod:`launch.group_launcher`) and by a headless node
(:mod:`launch.headless`). Each rank is ``python -m worker.main --config FILE``, where FILE
is its :class:`tpserve.config.RankConfig` as JSON: the cluster configuration, its global
rank, its place on this host (a rank's same-host peers are global ranks ``node_rank *
local_world_size + [0, local_world_size)``), the address its WorkerService binds and the
group's torch.distributed rendezvous. The files of one launch lie in a private temporary
directory (mode 0700, logged as ``config_dir``) until the ranks stop. No torch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import structlog

from launch.topology import GroupLayout
from tpserve.cluster_secret import ENV_VAR, read_secret
from tpserve.kv_wire import KV_CONTROL_KEY_ENV
from tpserve.config import ClusterConfig, RankConfig

log = structlog.get_logger(__name__)

#: Seconds a rank gets to exit after SIGTERM before SIGKILL.
WORKER_EXIT_SECONDS = 5.0
#: Seconds between checks that every rank still runs.
POLL_SECONDS = 0.5


def describe_exit(rank: int, code: int) -> str:
    """How a rank of this host ended, naming the rank, the host and the cause: "rank 1 on host h
    was killed by SIGKILL (exit code -9)" or "rank 1 on host h exited with code 1"."""
    host = socket.gethostname()
    if code < 0:
        try:
            cause = signal.Signals(-code).name
        except ValueError:
            cause = f"signal {-code}"
        return f"rank {rank} on host {host} was killed by {cause} (exit code {code})"
    return f"rank {rank} on host {host} exited with code {code}"


class LocalRanks:
    """The ranks of one node of a group.

    Args:
        config: the cluster configuration (model, dtype, cache and timeout flags).
        model_dir: the checkpoint directory.
        layout: the group's placement; this node is ``layout.node_rank``.
        log_format: "console" or "json", passed to the ranks.
        kv_control_key: the group's KV control key (``--kv-transfer-config``), which the ranks' KV agents
            require of every hold and pull: only this launcher's coordinator has it (None: none).
    """

    def __init__(self, config: ClusterConfig, model_dir: Path, layout: GroupLayout, log_format: str,
                 kv_control_key: str | None = None) -> None:
        self.kv_control_key = kv_control_key
        self.config = config
        self.model_dir = model_dir
        self.layout = layout
        self.log_format = log_format
        self.procs: dict[int, subprocess.Popen] = {}  # global rank -> process
        self.config_dir: Path | None = None  # the running launch's rank configs

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
        if self.kv_control_key:  # the same way: environments are the owner's to read, command lines anyone's
            env[KV_CONTROL_KEY_ENV] = self.kv_control_key
        if interface is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
        self.config_dir = Path(tempfile.mkdtemp(prefix="tpserve-ranks-"))
        for rank in self.layout.node_ranks():
            path = self.config_dir / f"rank{rank}.json"
            path.write_text(self.rank_config(rank, addresses[rank], init_method).to_json())
            # A session of their own: Ctrl-C in a terminal, or SIGINT/SIGTERM to the
            # coordinator's process group (a container runtime, ``kill -- -PGID``), must
            # reach the coordinator only, which drains in-flight requests and then stops
            # the ranks (docs/design/faults.md, "Ranks leave shutdown to the coordinator"). A rank still exits when
            # its parent dies
            # (worker/main.py watches it).
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "worker.main", "--config", str(path)], env=env,
                                                start_new_session=True)
        log.info("ranks started", node_rank=self.layout.node_rank, ranks=list(self.procs),
                 init_method=init_method, interface=interface, config_dir=str(self.config_dir))

    def rank_config(self, rank: int, address: str, init_method: str) -> RankConfig:
        """What global ``rank`` of this node runs with (see :class:`tpserve.config.RankConfig`)."""
        layout = self.layout
        return RankConfig(cluster=self.config, model_dir=str(self.model_dir), rank=rank, world_size=layout.world_size,
                          local_rank=layout.local_rank(rank), local_world_size=layout.ranks_per_node,
                          node_rank=layout.node_rank, address=address, init_method=init_method,
                          log_format=self.log_format)

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
        """SIGTERM every rank, SIGKILL those still running after WORKER_EXIT_SECONDS; removes their configs."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(WORKER_EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.config_dir is not None:
            shutil.rmtree(self.config_dir, ignore_errors=True)
            self.config_dir = None
