"""The leader's side of a multi-host group: which nodes have joined, and where their ranks are.

The leader's coordinator serves ``tpserve.v1.NodeRegistry`` (proto/tpserve/v1/cluster.proto)
on ``--master-addr:--master-port``. Each headless node opens one ``JoinGroup`` stream,
names its ranks' TCP addresses, and keeps the stream open: it is the group's liveness
link. When every node has joined, the leader *seals* the group: it sends each node
``JoinAccepted`` (start your ranks now, with this rendezvous) and starts its own ranks,
so that every rank of every host reaches the torch.distributed rendezvous within
seconds of the others, however far apart the hosts started. Until then a node may
leave and join again (a restarted pod); after that, a node that leaves breaks the
group and ``on_lost`` is called once, with the reason. With recovery on
(``--worker-recovery-timeout-seconds``), the leader then :meth:`~NodeRegistry.reopen` s the
registry: the nodes still there are stopped, every node joins again and the group is
sealed anew, on a fresh rendezvous. No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from launch.topology import GroupLayout
from tpserve.v1 import cluster_pb2 as pb
from tpserve.v1 import cluster_pb2_grpc

log = structlog.get_logger(__name__)

# A JoinGroup stream is idle for hours; HTTP/2 pings find a leader or node that
# vanished without closing its connection (power loss, partition) within ~20 s.
CLIENT_KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000)]
SERVER_KEEPALIVE_OPTIONS = [("grpc.so_reuseport", 0),  # a port in use is an error, not shared
                            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000),
                            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                            ("grpc.http2.max_ping_strikes", 0)]


@dataclass(frozen=True, slots=True)
class GroupSettings:
    """What every node of a group must agree on; a node that differs is refused.

    Attributes:
        layout: the leader's view of the group (its ``node_rank`` is 0).
        model_config_sha256: SHA-256 (hex) of the model's config.json.
        dtype: the --dtype flag as given.
        block_size: tokens per KV block.
        quantization: the --quantization flag as given, "" when unset (ranks with
            int8 and float weights would compute different partial sums, silently).
        draft_model_config_sha256: SHA-256 (hex) of the draft model's config.json
            (``--speculative-method draft``), or "" without one.
        max_model_len: --max-model-len as resolved (the model's limit when unset); it
            sizes each rank's KV pool, so a node that differs would shrink the group's.
        tp_size: the tensor-parallel degree (--tensor-parallel-size).
        pp_size: pipeline stages (--pipeline-parallel-size); ``layout.world_size`` is ``tp_size * pp_size``.
        enable_expert_parallel: --enable-expert-parallel (ranks that split the experts
            differently would sum partials of different experts, silently).
        kv_cache_dtype: --kv-cache-dtype; it sets a rank's bytes per KV block, so a node that
            differs would hold another number of blocks in the same memory.

    Raises:
        ValueError: ``tp_size * pp_size`` is not ``layout.world_size``.
    """

    layout: GroupLayout
    model_config_sha256: str
    dtype: str
    block_size: int
    quantization: str = ""
    draft_model_config_sha256: str = ""
    max_model_len: int = 0
    tp_size: int = 1
    pp_size: int = 1
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.tp_size * self.pp_size != self.layout.world_size:
            raise ValueError(f"tp_size={self.tp_size} x pp_size={self.pp_size} is not the group's "
                             f"world_size={self.layout.world_size}")

    def mismatch(self, join: pb.JoinRequest) -> str | None:
        """Why ``join`` cannot be part of this group, or None."""
        layout = self.layout
        if not 0 < join.node_rank < layout.nnodes:
            return f"node_rank={join.node_rank} is outside [1, nnodes={layout.nnodes})"
        for name, theirs, ours in (
            ("nnodes", join.nnodes, layout.nnodes),
            ("tensor_parallel_size", join.tensor_parallel_size, self.tp_size),
            ("pipeline_parallel_size", join.pipeline_parallel_size or 1, self.pp_size),
            ("model config.json sha256", join.model_config_sha256, self.model_config_sha256),
            ("dtype", join.dtype, self.dtype),
            ("block_size", join.block_size, self.block_size),
            ("quantization", join.quantization or "none", self.quantization or "none"),
            ("draft model config.json sha256", join.draft_model_config_sha256, self.draft_model_config_sha256),
            ("--max-model-len", join.max_model_len, self.max_model_len),
            ("--enable-expert-parallel", join.enable_expert_parallel, self.enable_expert_parallel),
            ("--kv-cache-dtype", join.kv_cache_dtype or "auto", self.kv_cache_dtype),
        ):
            if theirs != ours:
                return f"node {join.node_rank} has {name}={theirs}, the leader {name}={ours}"
        if len(join.rank_addresses) != layout.ranks_per_node:
            return f"node {join.node_rank} names {len(join.rank_addresses)} ranks, expected {layout.ranks_per_node}"
        return None


@dataclass(eq=False)
class _Node:
    join: pb.JoinRequest
    peer: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)


class NodeRegistry(cluster_pb2_grpc.NodeRegistryServicer):
    """Collects the group's headless nodes.

    Args:
        settings: what every node must agree on.
        init_method: the torch.distributed rendezvous every rank joins.
        on_lost: called once, with the reason, when a node leaves a sealed group.
    """

    def __init__(self, settings: GroupSettings, init_method: str, on_lost: Callable[[str], None]) -> None:
        self.settings = settings
        self.init_method = init_method
        self._on_lost = on_lost
        self._nodes: dict[int, _Node] = {}
        self.complete = asyncio.Event()
        self._sealed = False
        self._lost = False

    # -- the leader's view -----------------------------------------------------------

    def missing_nodes(self) -> list[int]:
        """Node ranks that have not joined yet."""
        return [n for n in range(1, self.settings.layout.nnodes) if n not in self._nodes]

    def missing_ranks(self) -> list[int]:
        """Global ranks whose node has not joined yet."""
        return [r for n in self.missing_nodes() for r in self.settings.layout.node_ranks(n)]

    def seal(self) -> dict[int, str]:
        """Ends the joining phase: tells every node to start its ranks.

        Returns:
            Global rank -> gRPC address, for every rank on the other nodes.

        Raises:
            RuntimeError: a node is missing (it left since ``complete`` was set).
        """
        if self.missing_nodes():
            raise RuntimeError(f"nodes {self.missing_nodes()} have not joined")
        self._sealed = True
        layout = self.settings.layout
        for node in self._nodes.values():
            node.outbox.put_nowait(pb.LeaderMessage(accepted=pb.JoinAccepted(init_method=self.init_method)))
        return {rank: node.join.rank_addresses[layout.local_rank(rank)]
                for n, node in self._nodes.items() for rank in layout.node_ranks(n)}

    def reopen(self, reason: str) -> None:
        """The group restarts after a loss: back to the joining phase, every node forgotten.

        Nodes still connected are told to stop (``GroupShutdown`` with ``failed``: their
        ranks are part of the broken torch.distributed group, which restarts whole); they
        exit 1 and join again once their orchestrator (or an operator) starts them again,
        as the lost node does. ``complete`` is set again when every node has joined.
        """
        for node in self._nodes.values():
            node.outbox.put_nowait(pb.LeaderMessage(shutdown=pb.GroupShutdown(
                reason=f"the group restarts after a loss: {reason}", failed=True)))
        self._nodes.clear()  # their departures that follow are no loss (_left ignores them)
        self._sealed = False
        self._lost = False
        self.complete.clear()

    def shutdown(self, reason: str, failed: bool) -> None:
        """Tells every node to stop; their streams end once the message is written."""
        self._lost = True  # the nodes' departures that follow are expected
        for node in self._nodes.values():
            node.outbox.put_nowait(pb.LeaderMessage(shutdown=pb.GroupShutdown(reason=reason, failed=failed)))

    # -- the RPC -----------------------------------------------------------------------

    async def JoinGroup(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("join"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a JoinRequest")
        join = first.join
        problem = self.settings.mismatch(join)
        if problem:
            log.error("node refused", node_rank=join.node_rank, peer=context.peer(), reason=problem)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if self._sealed:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the group has started; node {join.node_rank} cannot join it: restart the whole group")
        if join.node_rank in self._nodes:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"node {join.node_rank} has already joined from {self._nodes[join.node_rank].peer}")
        node = _Node(join, context.peer())
        self._nodes[join.node_rank] = node
        log.info("node joined", node_rank=join.node_rank, peer=node.peer, ranks=list(join.rank_addresses),
                 missing_nodes=self.missing_nodes())
        if not self.missing_nodes():
            self.complete.set()
        await self._hold(node, context)

    async def _hold(self, node: _Node, context: grpc.aio.ServicerContext) -> None:
        """Relays the leader's messages until the node leaves or the leader shuts the group down."""
        reader = asyncio.ensure_future(_read_failure(context))
        reason = f"node {node.join.node_rank} ({node.peer}) lost its connection to the leader"
        outgoing: asyncio.Future | None = None
        try:
            while True:
                outgoing = asyncio.ensure_future(node.outbox.get())
                done, _ = await asyncio.wait({reader, outgoing}, return_when=asyncio.FIRST_COMPLETED)
                if outgoing not in done:
                    outgoing.cancel()
                    reason = reader.result() or f"node {node.join.node_rank} ({node.peer}) left the group"
                    return
                await context.write(outgoing.result())
                if outgoing.result().HasField("shutdown"):
                    return
        finally:
            reader.cancel()
            if outgoing is not None:
                outgoing.cancel()
            self._left(node, reason)

    def _left(self, node: _Node, reason: str) -> None:
        rank = node.join.node_rank
        if self._nodes.get(rank) is not node:
            return
        if not self._sealed:
            del self._nodes[rank]
            self.complete.clear()
            log.warning("node left before the group started; waiting for it again", node_rank=rank, reason=reason)
            return
        if not self._lost:
            self._lost = True
            log.error("node lost", node_rank=rank, reason=reason)
            self._on_lost(reason)


async def _read_failure(context: grpc.aio.ServicerContext) -> str:
    """Reads the node's messages until its stream ends; returns its failure reason, if it sent one."""
    while True:
        message = await context.read()
        if message is grpc.aio.EOF:
            return ""
        if message.HasField("failure"):
            return message.failure.reason
