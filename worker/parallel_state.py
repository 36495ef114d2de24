"""The tensor-parallel group of one worker rank, its collectives, and its pipeline stage.

Every parallel layer receives a :class:`ParallelContext` as an argument (never a
global) and calls its collectives from ``forward()``, where a reader sees them:

* ``all_reduce`` sums the partial outputs of a row-parallel layer or of the
  vocab-parallel embedding (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053);
* ``gather_to_rank0`` concatenates the LM head's vocab slices on rank 0, the only
  rank that samples.

Backend: NCCL on CUDA, gloo on CPU; the code path is otherwise the same. CPU
ranks that all share one host exchange activations through shared memory instead
of gloo (:mod:`worker.comm.shm_allreduce`: microseconds instead of ~0.4 ms per
collective). A group spread over hosts all-reduces in two levels, shared memory
within each host and gloo between one leader per host
(:mod:`worker.comm.two_level`); flat gloo stays the path for the other collectives
and for tensors too large for the shared slots. Every collective runs under the
group's timeout, so a lost rank fails the step with an error instead of hanging it.

Names (docs/design/cluster.md, "Parallel sizes: one name, one meaning"): ``tp_size``/``tp_rank`` are the tensor-parallel
degree and this rank's place in its stage's group; ``pp_size``/``pp_rank`` the pipeline
stages and this rank's stage; ``world_size`` is only ever ``tp_size * pp_size``, every rank
of the group, and ``global_rank`` a rank's index in it. With ``pp_size`` > 1 the ranks are
numbered stage-major (worker/pipeline.py): the context's group is this rank's stage (its
``tp_size`` ranks, one ``torch.distributed`` subgroup per stage).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from worker.comm import shm_allreduce
from worker.comm.shm_allreduce import SharedMemoryComm
from worker.comm.two_level import TwoLevelAllReduce
from worker.kernels import cpu_kernels_available
from worker.pipeline import PipelineStage
from worker.rendezvous import tcp_store

#: Largest tensor (bytes) a same-host collective carries through shared memory:
#: a 2048-token step of a 512-wide model, or the decode steps of any model up to
#: hidden size 16384 at 64 sequences. Larger ones go through gloo. The segment is
#: ``2 * tp_size`` slots of this size (32 MiB at tp 4).
SHM_MAX_BYTES = 4 * 1024**2


@dataclass(frozen=True)
class ParallelContext:
    """One rank's view of its tensor-parallel group and of its pipeline stage.

    Attributes:
        tp_rank: this process's rank in its stage's tensor-parallel group, ``[0, tp_size)``.
        tp_size: tensor-parallel degree (``tensor_parallel_size``): the ranks every layer is split over.
        device: where this rank's weights, KV cache and activations live.
        group: the ``torch.distributed`` process group of this stage's ``tp_size`` ranks, or None
            for the default group (and when ``tp_size == 1``, where no collective runs).
        shm: shared-memory collectives when every rank is a CPU rank on this
            host; None: gloo/NCCL only.
        two_level: the all-reduce of CPU ranks spread over hosts, two or more
            of them on one host (shared memory within hosts, gloo between them); None otherwise.
        pp: this rank's pipeline stage (one stage by default).
        enable_expert_parallel: ``--enable-expert-parallel``: the mixture-of-experts layers hold
            ``num_experts / tp_size`` whole experts per rank instead of a slice of every expert
            (worker/layers/moe.py); every other layer is split as without it.
    """

    tp_rank: int
    tp_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    shm: SharedMemoryComm | None = None
    two_level: TwoLevelAllReduce | None = None
    pp: PipelineStage = dataclasses.field(default_factory=PipelineStage)
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside [0, tp_size={self.tp_size})")

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelContext:
        """A group of one rank: every collective is a no-op."""
        return cls(tp_rank=0, tp_size=1, device=torch.device(device))

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage, ``[0, pp_size)``."""
        return self.pp.pp_rank

    @property
    def pp_size(self) -> int:
        """Pipeline stages (``pipeline_parallel_size``)."""
        return self.pp.pp_size

    @property
    def world_size(self) -> int:
        """Every rank of the group: ``tp_size * pp_size``."""
        return self.tp_size * self.pp.pp_size

    @property
    def global_rank(self) -> int:
        """This rank's index among all ``world_size`` ranks (stage-major: ``pp_rank * tp_size + tp_rank``)."""
        return self.pp.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_rank0(self) -> bool:
        """True on rank 0 of this tensor-parallel group (the rank the LM head's logits are gathered on)."""
        return self.tp_rank == 0

    @property
    def all_reduce_path(self) -> str:
        """How this rank's small all-reduces travel, for the logs: "shared memory", "two levels"
        (shared memory within hosts, gloo between them), "gloo", "nccl" or "none" (one rank)."""
        if self.tp_size == 1:
            return "none"
        if self.shm is not None:
            return "shared memory"
        if self.two_level is not None:
            return "two levels"
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def is_sampler(self) -> bool:
        """True on the rank that samples and reports tokens: rank 0 of the last pipeline stage."""
        return self.tp_rank == 0 and self.pp.is_last

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over this stage's ``tp_size`` ranks, in place; returns ``x`` (any shape and dtype)."""
        if self.tp_size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        if self.two_level is not None and self.two_level.fits(x):
            return self.two_level.all_reduce(x)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel rank 0's ``x`` on every rank of the stage, in place; returns ``x`` (the same shape
        and dtype on every rank)."""
        if self.tp_size == 1:
            return x
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(x, src=src, group=self.group)
        return x

    def gather_to_rank0(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every tensor-parallel rank's ``x`` along ``dim``, in ``tp_rank`` order, on tp rank 0.

        Args:
            x: this rank's part; every rank must pass the same shape and dtype.
            dim: the dimension to concatenate along.

        Returns:
            On tp rank 0 the concatenation (``x.shape[dim] * tp_size`` along
            ``dim``); None on the other ranks.
        """
        if self.tp_size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            gathered = self.shm.all_gather(x, dim)  # every rank takes part; only rank 0 keeps it
            return gathered if self.tp_rank == 0 else None
        x = x.contiguous()
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        if self.tp_rank != 0:
            dist.gather(x, gather_list=None, dst=dst, group=self.group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.gather(x, gather_list=parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim)


def rank_context(rank: int, tp_size: int, pp_size: int, device: str | torch.device) -> ParallelContext:
    """Global ``rank``'s context in a group of ``pp_size`` stages of ``tp_size`` ranks, before any
    process group exists (``group``, ``shm`` and ``two_level`` unset; :func:`init_distributed` sets them).

    Raises:
        ValueError: ``tp_size`` or ``pp_size`` below 1, or ``rank`` outside ``[0, tp_size * pp_size)``.
    """
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp_size={tp_size} and pp_size={pp_size} must be >= 1")
    stage = PipelineStage.of_rank(rank, tp_size, pp_size)  # stage-major: pp_rank = rank // tp_size
    return ParallelContext(tp_rank=rank % tp_size, tp_size=tp_size, device=torch.device(device), pp=stage)


def init_distributed(
    rank: int,
    tp_size: int,
    init_method: str,
    device: str | torch.device,
    timeout_s: float,
    *,
    shared_memory: bool = True,
    pp_size: int = 1,
    enable_expert_parallel: bool = False,
) -> ParallelContext:
    """Join the group of ``world_size = tp_size * pp_size`` ranks and return this rank's context
    (its stage's tensor-parallel group).

    Args:
        rank: this process's global rank, ``0 <= rank < tp_size * pp_size``.
        tp_size: ``tensor_parallel_size``, the ranks of each stage.
        init_method: rendezvous URL shared by all ranks, e.g. ``"tcp://10.0.0.1:29500"``.
        device: ``"cpu"`` (gloo backend) or an indexed CUDA device such as ``"cuda:0"``
            (NCCL), one per rank: the rank's local GPU (worker/device.py picks it).
        timeout_s: seconds a collective may wait for the other ranks before it fails.
        shared_memory: let CPU ranks of a stage that share a host use shared-memory
            collectives: all of them when the stage is on one host, else the two-level
            all-reduce (one stage only: with pipeline stages, a stage over hosts uses gloo).
        pp_size: ``pipeline_parallel_size``, the stages; global rank ``r`` is tensor-parallel rank
            ``r % tp_size`` of stage ``r // tp_size`` (worker/pipeline.py).
        enable_expert_parallel: whole experts per rank (:attr:`ParallelContext.enable_expert_parallel`).

    Returns:
        The context. With ``world_size == 1`` no process group is created and
        ``init_method`` is not contacted.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, ``timeout_s <= 0``, a CUDA device without an index,
            or ``tp_size`` or ``pp_size`` below 1.
        RuntimeError / DistStoreError: the rendezvous failed or timed out.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # No guessing (a modulo would put two ranks on one GPU, which NCCL refuses).
        raise ValueError("init_distributed needs an indexed CUDA device (cuda:<local rank>), got 'cuda'")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = dataclasses.replace(rank_context(rank, tp_size, pp_size, device), enable_expert_parallel=enable_expert_parallel)
    stage, world_size = ctx.pp, ctx.world_size
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        return ctx
    # tcp://: rank 0's store listens on the rendezvous address only (worker/rendezvous.py).
    store = tcp_store(init_method, rank, world_size, timeout_s)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        **({"store": store} if store is not None else {"init_method": init_method}),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    if pp_size > 1:
        # Every rank creates every stage's subgroup, in the same order (torch.distributed's rule).
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timedelta(seconds=timeout_s))
                  for s in range(pp_size)]
        ctx = dataclasses.replace(ctx, group=groups[stage.pp_rank])
    if device.type == "cpu" and shared_memory and tp_size > 1:
        shm, two_level = _open_shared_memory(ctx.tp_rank, tp_size, timeout_s, ctx.group, across_hosts=pp_size == 1)
        ctx = dataclasses.replace(ctx, shm=shm, two_level=two_level)
    return ctx


def _host_identity() -> str:
    """Which machine (kernel instance) this process runs on: ranks with equal identities share /dev/shm."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def _open_shared_memory(tp_rank: int, tp_size: int, timeout_s: float, group: dist.ProcessGroup | None = None,
                        *, across_hosts: bool = True) -> tuple[SharedMemoryComm | None, TwoLevelAllReduce | None]:
    """Map one shared segment per host among the group's ranks on it: ``(shm, None)`` when the whole group
    shares this host, ``(None, two_level)`` when it spans hosts and some host holds two or more of its
    ranks (``across_hosts``), else ``(None, None)`` (gloo only).

    ``tp_rank``/``tp_size``: this rank and the ranks of ``group``, the stage's tensor-parallel group (None:
    the default group, whose ranks are then the global ones: one stage).

    A collective itself (every rank must call it). Each host's first rank creates its file, every rank
    of the host maps it, then the creator unlinks it, so no file outlives the group even if a rank is
    killed later. Any failure on any host leaves the whole group on gloo.
    """
    identities: list[tuple[str, int, bool] | None] = [None] * tp_size
    me = (_host_identity(), os.getpid(), cpu_kernels_available()) if shm_allreduce.supported() else None
    dist.all_gather_object(identities, me, group=group)
    if any(i is None for i in identities):
        return None, None  # not x86-64 somewhere: gloo
    hosts = [i[0] for i in identities]  # type: ignore[index]
    local = [r for r in range(tp_size) if hosts[r] == hosts[tp_rank]]  # this host's ranks, in group order
    one_host = len(local) == tp_size
    if not one_host and (not across_hosts or len(set(hosts)) == tp_size):
        return None, None  # a rank per host: nothing to share
    pids = [identities[r][1] for r in local]  # type: ignore[index]
    compiled = all(identities[r][2] for r in local)  # type: ignore[index]  # one protocol version per segment
    creator = tp_rank == local[0] and len(local) > 1
    path = f"/dev/shm/tpserve-{uuid.uuid4().hex}" if creator else None
    comm: SharedMemoryComm | None = None
    if creator:
        try:
            comm = SharedMemoryComm(path, 0, len(local), SHM_MAX_BYTES, timeout_s, create=True, peer_pids=pids,
                                    compiled=compiled)
        except OSError:
            path = None
    paths: list[str | None] = [None] * tp_size
    dist.all_gather_object(paths, path, group=group)
    if not creator and paths[local[0]] is not None:
        try:
            comm = SharedMemoryComm(paths[local[0]], local.index(tp_rank), len(local), SHM_MAX_BYTES, timeout_s,
                                    create=False, peer_pids=pids, compiled=compiled)
        except OSError:
            comm = None
    opened: list[bool | None] = [None] * tp_size
    dist.all_gather_object(opened, comm is not None or len(local) == 1, group=group)
    if path is not None:
        os.unlink(path)  # every rank of this host has mapped it (or failed to)
    if not all(opened):
        if comm is not None:
            comm.close()
        return None, None
    if one_host:
        return comm, None
    # Every rank creates the leaders' group (torch.distributed's rule for new_group); only leaders use it.
    leader_ranks = sorted({hosts.index(h) for h in hosts})
    leaders = dist.new_group(leader_ranks, timeout=timedelta(seconds=timeout_s))
    return None, TwoLevelAllReduce(comm, leaders if tp_rank in leader_ranks else None, SHM_MAX_BYTES)


def destroy_distributed() -> None:
    """Leave the process group, if one was created (safe to call more than once)."""
    if dist.is_initialized():
        dist.destroy_process_group()
