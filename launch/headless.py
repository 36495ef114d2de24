"""``tpserve serve --headless``: this host's ranks of a group whose coordinator runs elsewhere.

Life of a headless node (node_rank > 0):
  1. refuse a model that cannot be split at the asked tensor_parallel_size;
  2. retry the leader's registry (``--master-addr:--master-port``) with backoff until
     ``--worker-start-timeout-seconds``, then give up naming the address; the
     connection also tells which local interface reaches the leader;
  3. join the group (``tpserve.v1.NodeRegistry.JoinGroup``), naming where its ranks
     will serve: ``<that interface's address>:<master_port + 2 + local_rank>``;
  4. when the leader answers that every node has joined, start the local ranks on
     the group's torch.distributed rendezvous;
  5. run until the leader stops the group (exit 0 for an orderly stop, else 1), a
     local rank exits (tell the leader, exit 1), or SIGTERM/SIGINT (exit 0).
No public API here, no coordinator module (tests/test_import_rules.py checks it) and no torch (the
ranks are separate processes).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import structlog

from launch.local_ranks import LocalRanks, describe_exit
from launch.netutil import PeerTimeout, host_port, interface_of, wait_for_peer
from launch.node_registry import CLIENT_KEEPALIVE_OPTIONS
from launch.startup import (StartupError, config_sha256, draft_config_sha256, model_dir_of, read_group_secret,
                            read_model_config)
from launch.topology import GroupLayout, rank_port
from tpserve.cluster_secret import client_interceptors
from tpserve.config import ClusterConfig
from tpserve.v1 import cluster_pb2 as pb
from tpserve.v1 import cluster_pb2_grpc

log = structlog.get_logger(__name__)

#: Seconds the leader gets to read a node's failure reason before the node hangs up.
FAILURE_DELIVERY_SECONDS = 2.0


class HeadlessNode:
    """One non-leader host of a multi-host group. ``await HeadlessNode(config).serve()`` returns the exit code.

    Raises:
        StartupError: the model cannot be split at this tensor_parallel_size.
    """

    def __init__(self, config: ClusterConfig, log_format: str = "console") -> None:
        par = config.parallel
        self.config = config
        self.layout = GroupLayout(par.world_size, par.nnodes, par.node_rank)
        self.model_dir = model_dir_of(config)
        model_len = read_model_config(self.model_dir, par.tensor_parallel_size, par.pipeline_parallel_size,
                                      par.enable_expert_parallel,
                                      quantization=config.load.quantization).max_position_embeddings
        #: Resolved like the leader's (launch/leader.py); the leader refuses a node whose value differs.
        self.max_model_len = config.scheduler.max_model_len or model_len
        self.ranks = LocalRanks(config, self.model_dir, self.layout, log_format)
        self.leader = host_port(par.master_addr, par.master_port)
        self.secret = read_group_secret(config)
        self._stop: asyncio.Event | None = None

    async def serve(self) -> int:
        """Waits for the leader, joins, runs the local ranks; returns the process exit code.

        Raises:
            StartupError: the leader never answered, or refused this node (the message says why).
        """
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stop.set)
        # SIGHUP reloads the leader's keys and certificates; a headless node has none: it must not die of it.
        loop.add_signal_handler(signal.SIGHUP, lambda: log.info("SIGHUP: nothing to reload on a headless node"))
        par, timeout_s = self.config.parallel, self.config.server.worker_start_timeout_seconds
        try:
            local_ip = await self._until_stopped(wait_for_peer(par.master_addr, par.master_port, timeout_s, "the leader"))
        except PeerTimeout as exc:
            raise StartupError(f"node {par.node_rank}: {exc}") from None
        if local_ip is None:
            return 0
        channel = grpc.aio.insecure_channel(self.leader, options=CLIENT_KEEPALIVE_OPTIONS,
                                            interceptors=client_interceptors(self.secret))
        call = cluster_pb2_grpc.NodeRegistryStub(channel).JoinGroup(wait_for_ready=True)
        try:
            init_method = await self._join(call, local_ip, timeout_s)
            if init_method is None:
                return 0
            addresses = {rank: host_port(local_ip, rank_port(par.master_port, self.layout.local_rank(rank)))
                         for rank in self.layout.node_ranks()}
            self.ranks.start(addresses, init_method, interface_of(local_ip))
            return await self._watch(call)
        finally:
            call.cancel()
            await channel.close()
            self.ranks.stop()
            log.info("stopped", node_rank=par.node_rank)

    async def _join(self, call, local_ip: str, timeout_s: float) -> str | None:
        """Sends the JoinRequest; returns the group's init_method once the leader accepts (None: stopped)."""
        par = self.config.parallel
        addresses = [host_port(local_ip, rank_port(par.master_port, r)) for r in range(self.layout.ranks_per_node)]
        await call.write(pb.NodeMessage(join=pb.JoinRequest(
            node_rank=par.node_rank, nnodes=par.nnodes, tensor_parallel_size=par.tensor_parallel_size,
            pipeline_parallel_size=par.pipeline_parallel_size, enable_expert_parallel=par.enable_expert_parallel,
            model_config_sha256=config_sha256(self.model_dir), dtype=self.config.load.dtype,
            block_size=self.config.cache.block_size, rank_addresses=addresses,
            quantization=self.config.load.quantization or "",
            draft_model_config_sha256=draft_config_sha256(self.config), max_model_len=self.max_model_len,
            kv_cache_dtype=self.config.cache.kv_cache_dtype)))
        log.info("joined; waiting for every node", leader=self.leader, node_rank=par.node_rank, ranks=addresses)
        started = time.monotonic()
        try:
            answer = await self._until_stopped(asyncio.wait_for(call.read(), timeout_s))
        except asyncio.TimeoutError:
            raise StartupError(f"node {par.node_rank}: the leader at {self.leader} did not start the group "
                               f"within {timeout_s:g} s") from None
        except grpc.aio.AioRpcError as exc:
            raise StartupError(f"node {par.node_rank}: the leader at {self.leader} ended the join: "
                               f"{exc.code().name}: {exc.details()}") from None
        if answer is None:
            return None
        if answer is grpc.aio.EOF or not answer.HasField("accepted"):
            raise StartupError(f"node {par.node_rank}: the leader at {self.leader} closed the group before it started")
        log.info("group complete; starting ranks", init_method=answer.accepted.init_method,
                 waited_s=round(time.monotonic() - started, 3))
        return answer.accepted.init_method

    async def _watch(self, call) -> int:
        """Runs until the leader stops the group, a local rank exits, or a signal; returns the exit code."""
        from_leader = asyncio.ensure_future(call.read())
        try:
            return await self._watch_until(call, from_leader)
        finally:
            # Cancelled only once the failure reason is delivered: grpc.aio cancels the whole call when a pending
            # read is cancelled, and the reason written after it was then lost (the leader reported "node 1 ...
            # lost its connection to the leader" instead of the rank and its signal).
            from_leader.cancel()

    async def _watch_until(self, call, from_leader: asyncio.Future) -> int:
        """:meth:`_watch` with the read of the leader's next message (``from_leader``) already pending."""
        rank_exit = asyncio.ensure_future(self.ranks.wait_first_exit())
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({from_leader, rank_exit, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (rank_exit, stopped):
                task.cancel()
        node = self.config.parallel.node_rank
        if rank_exit in done:
            rank, code = rank_exit.result()
            reason = f"node {node}: {describe_exit(rank, code)}"
            log.error("rank exited", rank=rank, returncode=code)
            await _send_failure(call, reason)
            return 1
        if stopped in done:
            await _send_failure(call, f"node {node} was stopped by a signal")
            return 0
        try:
            message = from_leader.result()
        except grpc.aio.AioRpcError as exc:
            log.error("lost the leader", leader=self.leader, error=f"{exc.code().name}: {exc.details()}")
            return 1
        if message is grpc.aio.EOF or not message.HasField("shutdown"):
            log.error("lost the leader", leader=self.leader, error="the stream ended without a shutdown")
            return 1
        log.info("the leader stopped the group", reason=message.shutdown.reason, failed=message.shutdown.failed)
        return 1 if message.shutdown.failed else 0

    async def _until_stopped(self, awaitable):
        """Awaits ``awaitable``; returns None instead if a signal stops the node first."""
        task = asyncio.ensure_future(awaitable)
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not task.done():
            task.cancel()
            return None
        return task.result()


async def _send_failure(call, reason: str) -> None:
    try:
        await call.write(pb.NodeMessage(failure=pb.NodeFailure(reason=reason)))
        await call.done_writing()
        # Let the leader read the reason before the call is cancelled.
        await asyncio.wait_for(call.code(), FAILURE_DELIVERY_SECONDS)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.TimeoutError):
        pass  # the leader is gone already
