"""The leader's worker group: this host's ranks and, across hosts, the node registry that gathers the others.

One host: the ranks' torch.distributed rendezvous is a file in a private socket directory
(no listener), and their collectives use the loopback interface. Several hosts
(``--nnodes``): serve the node registry on ``--master-addr:--master-port``
(:mod:`launch.node_registry`) and wait, logging the missing ranks, until every headless node
has joined and named its ranks' TCP addresses; then release them all and use
``master_port + 1`` as the rendezvous. Either way this host's ranks start
(:mod:`launch.local_ranks`), each on a unix socket, and :class:`GroupLauncher` returns once
every rank of every host has loaded its shard, with the KV blocks the smallest rank can hold.
A restart (:mod:`launch.recovery`) does the same on fresh names and a fresh rendezvous.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from coordinator.worker_client import WorkerGroup, WorkerGroupError
from launch.local_ranks import LocalRanks, describe_exit
from launch.netutil import PeerTimeout, host_port, interface_of, port_taken, resolve
from launch.node_registry import SERVER_KEEPALIVE_OPTIONS, GroupSettings, NodeRegistry
from launch.startup import StartupError, bind, config_sha256, draft_config_sha256
from launch.topology import GroupLayout, store_port
from tpserve.cluster_secret import AioSecretServerInterceptor
from tpserve.config import ClusterConfig
from tpserve.pipeline_split import sampling_rank
from tpserve.v1 import cluster_pb2_grpc

log = structlog.get_logger(__name__)

#: Seconds the other nodes' streams get to carry the leader's goodbye (launch/shutdown.py counts them).
NODES_GOODBYE_SECONDS = 2.0

#: Seconds between "waiting for nodes" log lines.
WAITING_LOG_SECONDS = 10.0


class GroupLauncher:
    """Starts, restarts and stops a leader's worker group.

    Args:
        config: the cluster configuration.
        model_dir: the served checkpoint.
        layout: the group's placement (this node is 0).
        secret: the group's cluster secret, or None.
        max_model_len: the resolved longest sequence, which every node must share.
        log_format: the ranks' log format.
        on_lost: called with the reason when a local rank exits or a node leaves a sealed group.
        kv_control_key: the group's KV control key, handed to the local ranks (``--kv-transfer-config``).

    Attributes:
        workers: the coordinator's client of every rank, once launched.
        registry: the node registry (``nnodes > 1``), once serving.
    """

    def __init__(self, config: ClusterConfig, model_dir: Path, layout: GroupLayout, secret: str | None,
                 max_model_len: int, log_format: str, on_lost: Callable[[str], object],
                 kv_control_key: str | None = None) -> None:
        self.config = config
        self.model_dir = model_dir
        self.layout = layout
        self.secret = secret
        self.max_model_len = max_model_len
        self.on_lost = on_lost
        self.ranks = LocalRanks(config, model_dir, layout, log_format, kv_control_key)
        self.registry: NodeRegistry | None = None
        self.workers: WorkerGroup | None = None
        self._registry_server: grpc.aio.Server | None = None
        self._monitor_task: asyncio.Task | None = None
        self._socket_dir = Path(tempfile.mkdtemp(prefix="tpserve-"))
        self._launches = 0  # rank launches so far (each gets fresh socket names)
        self._group_interface: str | None = None  # nnodes > 1: the interface the group's collectives use

    async def start(self, deadline: float) -> int:
        """Gathers the group, starts this host's ranks, waits for every rank; returns the KV blocks all can hold.

        Raises:
            StartupError: the registry's address cannot be resolved or bound.
            WorkerGroupError: a node did not join, or a rank did not load, by ``deadline`` (monotonic seconds).
        """
        if self.layout.nnodes == 1:
            addresses, init_method, interface = self._local_endpoints()
        else:
            addresses = self._local_endpoints()[0]
            init_method, interface = await self._start_registry(deadline)
            self._group_interface = interface
            addresses.update(await self._wait_for_nodes(deadline))
        return await self._launch_ranks(addresses, init_method, interface, deadline)

    async def restart(self, reason: str, deadline: float, timeout_s: float) -> int:
        """After :meth:`stop_ranks`: the same group again, on fresh sockets and a fresh rendezvous; with
        ``nnodes > 1`` every node joins again first. Returns the KV blocks all ranks can hold.

        Raises:
            WorkerGroupError: a node did not join or a rank did not load by ``deadline``, naming them
                (their own deadline: an outer timeout at the same moment would end it with no reason).
            OSError: a rank could not be started.
        """
        addresses, init_method, interface = self._local_endpoints()
        if self.layout.nnodes > 1:
            self.registry.reopen(reason)
            init_method, interface = self.registry.init_method, self._group_interface
            addresses.update(await self._wait_for_nodes(deadline, timeout_s))
        return await self._launch_ranks(addresses, init_method, interface, deadline)

    def _local_endpoints(self) -> tuple[dict[int, str], str, str]:
        """Fresh unix socket addresses for this host's ranks, and a single-host rendezvous.

        Each launch gets new names (a restarted group must not meet its predecessor's
        sockets or rendezvous file). No network listener at all for the rendezvous (a
        TCPStore listens on every interface, whatever address it is given), and
        gloo's/NCCL's own sockets on the loopback interface: nothing of a one-host
        group is reachable from another host.
        """
        self._launches += 1
        tag = self._launches
        addresses = {rank: f"unix://{self._socket_dir}/rank{rank}-{tag}.sock" for rank in self.layout.node_ranks()}
        return addresses, f"file://{self._socket_dir}/rendezvous-{tag}", interface_of("127.0.0.1") or "lo"

    async def _launch_ranks(self, addresses: dict[int, str], init_method: str, interface: str | None,
                            deadline: float) -> int:
        """Starts this host's ranks and waits until every rank has loaded; returns the blocks all can hold."""
        self.ranks.start(addresses, init_method, interface)
        self._monitor_task = asyncio.create_task(self._monitor_ranks())
        par = self.config.parallel
        self.workers = WorkerGroup([addresses[rank] for rank in range(self.layout.world_size)],
                                   self.config.server.step_timeout_seconds, secret=self.secret,
                                   sampling_rank=sampling_rank(par.tensor_parallel_size, par.pipeline_parallel_size))
        return await self.workers.wait_ready(max(deadline - time.monotonic(), 0.0))

    async def _monitor_ranks(self) -> None:
        rank, code = await self.ranks.wait_first_exit()
        self.on_lost(describe_exit(rank, code))

    async def _start_registry(self, deadline: float) -> tuple[str, str | None]:
        """Serves the node registry on --master-addr:--master-port.

        Returns:
            The group's init_method and the network interface its collectives use.
        """
        par = self.config.parallel
        try:
            ip = await resolve(par.master_addr, max(deadline - time.monotonic(), 0.0), "--master-addr")
        except PeerTimeout as exc:
            raise StartupError(str(exc)) from None
        interceptors = [AioSecretServerInterceptor(self.secret)] if self.secret else []
        server = grpc.aio.server(options=SERVER_KEEPALIVE_OPTIONS, interceptors=interceptors)
        bound: str | None = ip
        if bind(server, host_port(ip, par.master_port)) == 0:
            # The name resolves to an address this host does not hold (NAT): listen everywhere.
            log.warning("--master-addr is not an address of this host; the node registry listens on every interface",
                        master_addr=par.master_addr, resolved=ip)
            bound = None
            if bind(server, f"0.0.0.0:{par.master_port}") == 0:
                raise StartupError(f"cannot bind the node registry on port {par.master_port} (--master-port)")
        # Rank 0 binds the store's port only after every node has joined and its shard has loaded, and its
        # failure then read "rank 0: OSError: [Errno 98] Address already in use", naming neither port nor flag.
        taken = port_taken(bound or "0.0.0.0", store_port(par.master_port))
        if taken is not None:
            await server.stop(None)
            raise StartupError(f"--master-port {par.master_port}: the group's rendezvous store uses the next port, "
                               f"{store_port(par.master_port)}, and cannot bind it ({taken.strerror}); stop the "
                               "process that listens there or choose another --master-port")
        init_method = f"tcp://{host_port(bound or par.master_addr, store_port(par.master_port))}"
        settings = GroupSettings(self.layout, config_sha256(self.model_dir), self.config.load.dtype,
                                 self.config.cache.block_size, self.config.load.quantization or "",
                                 draft_config_sha256(self.config), self.max_model_len,
                                 tp_size=par.tensor_parallel_size, pp_size=par.pipeline_parallel_size,
                                 enable_expert_parallel=par.enable_expert_parallel,
                                 kv_cache_dtype=self.config.cache.kv_cache_dtype)
        self.registry = NodeRegistry(settings, init_method, on_lost=self.on_lost)
        cluster_pb2_grpc.add_NodeRegistryServicer_to_server(self.registry, server)
        await server.start()
        self._registry_server = server
        log.info("node registry listening", address=host_port(bound or "0.0.0.0", par.master_port),
                 init_method=init_method)
        return init_method, interface_of(bound) if bound else None

    async def _wait_for_nodes(self, deadline: float, timeout_s: float | None = None) -> dict[int, str]:
        """Waits until every headless node has joined, logging the missing ranks; returns their addresses.
        ``timeout_s``: what the deadline was set from, for the error (default: --worker-start-timeout-seconds)."""
        registry = self.registry
        timeout_s = self.config.server.worker_start_timeout_seconds if timeout_s is None else timeout_s
        while registry.missing_nodes():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerGroupError(f"nodes {registry.missing_nodes()} (ranks {registry.missing_ranks()}) did not "
                                       f"join within {timeout_s:g} s")
            # INFO, the start-up's progress: a warning repeated within a minute is dropped (tpserve/log.py), and
            # five of every six of these lines were.
            log.info("waiting for nodes", missing_nodes=registry.missing_nodes(), missing_ranks=registry.missing_ranks(),
                     seconds_left=round(remaining))
            try:
                await asyncio.wait_for(registry.complete.wait(), min(remaining, WAITING_LOG_SECONDS))
            except asyncio.TimeoutError:
                pass
        remote = registry.seal()
        log.info("every node has joined", ranks=remote)
        return remote

    async def stop_ranks(self) -> None:
        """Stops watching the ranks, closes the coordinator's streams to them and stops this host's
        (survivors too: a torch.distributed group restarts whole). For a restart."""
        if self._monitor_task is not None and self._monitor_task is not asyncio.current_task():
            self._monitor_task.cancel()
        await self.workers.close()
        await asyncio.to_thread(self.ranks.stop)

    async def shut_down(self, failed: bool) -> None:
        """The end: tells the other nodes to stop (exit 1 where ``failed``), stops this host's ranks and
        removes the socket directory; leaves no process behind."""
        if self._monitor_task is not None:
            self._monitor_task.cancel()
        if self.workers is not None:
            # First: the other nodes' ranks end their step streams once told to stop, and the group
            # watches those streams for failures (coordinator/worker_client.py, _watch).
            await self.workers.close()
        if self.registry is not None:
            self.registry.shutdown("the group failed" if failed else "the leader stopped", failed=failed)
        if self._registry_server is not None:
            await self._registry_server.stop(NODES_GOODBYE_SECONDS)
        self.ranks.stop()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
