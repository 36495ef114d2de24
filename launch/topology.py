"""Where each rank of a worker group runs, and which ports the group uses.

A group of ``world_size = tensor_parallel_size * pipeline_parallel_size`` ranks spans
``nnodes`` hosts, ``L = world_size / nnodes`` ranks per host, in blocks: node ``n`` holds global
ranks ``n*L .. n*L+L-1`` and local rank ``r`` of node ``n`` is global rank ``n*L + r``
(local rank ``r`` uses ``cuda:r`` where there are GPUs). Node 0, the leader, runs
the coordinator; so global rank 0, which samples and hosts the torch.distributed
store, is always on the leader's host.

Ports, all derived from ``--master-port`` P so that one number configures a group
(SGLang derives its ports the same way):

========================  ===========  =============================================
port                      host         what
========================  ===========  =============================================
P                         leader       node registry (``tpserve.v1.NodeRegistry``)
P + 1                     leader       torch.distributed TCPStore (rank 0 hosts it)
P + 2 + r                 other nodes  local rank r's WorkerService (gRPC)
ephemeral                 every node   gloo / NCCL connections between ranks
========================  ===========  =============================================

The leader's own ranks serve on unix sockets: its coordinator is on the same host.
No torch here: the coordinator and the headless launcher read this.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """The placement of one group's ranks over its hosts.

    Attributes:
        world_size: the group's number of ranks, ``tensor_parallel_size * pipeline_parallel_size``
            (``ParallelConfig.world_size``); placement needs no more than that.
        nnodes: hosts in the group.
        node_rank: this host's index (0 = leader).

    Raises:
        ValueError: ``world_size`` not divisible by ``nnodes``, or ``node_rank``
            outside ``[0, nnodes)``.
    """

    world_size: int
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"world_size={self.world_size} is not divisible by nnodes={self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is outside [0, nnodes={self.nnodes})")

    @property
    def ranks_per_node(self) -> int:
        """L, the ranks on each host (``local_world_size``)."""
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int | None = None) -> range:
        """The global ranks on ``node_rank`` (default: this node), in local-rank order."""
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        """The node that runs global ``rank``."""
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """Global ``rank``'s index among its host's ranks (its GPU index there)."""
        return rank % self.ranks_per_node


def store_port(master_port: int) -> int:
    """The torch.distributed TCPStore port of a multi-host group (on the leader)."""
    return master_port + 1


def rank_port(master_port: int, local_rank: int) -> int:
    """The WorkerService port of local rank ``local_rank`` on a headless node."""
    return master_port + 2 + local_rank
