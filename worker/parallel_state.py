"""The tensor-parallel group of one worker rank, and its two collectives.

Every parallel layer receives a :class:`ParallelContext` as an argument (never a
global) and calls its collectives from ``forward()``, where a reader sees them:

* ``all_reduce`` sums the partial outputs of a row-parallel layer or of the
  vocab-parallel embedding (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053);
* ``gather_to_rank0`` concatenates the LM head's vocab slices on rank 0, the only
  rank that samples.

Backend: NCCL on CUDA, gloo on CPU; the code path is otherwise the same. Every
collective runs under the group's timeout, so a lost rank fails the step with an
error instead of hanging it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """One rank's view of its tensor-parallel group.

    Attributes:
        rank: this process's rank in ``[0, world_size)``.
        world_size: tensor-parallel degree (``tensor_parallel_size``).
        device: where this rank's weights, KV cache and activations live.
        group: the ``torch.distributed`` process group, or None for the default
            group (and when ``world_size == 1``, where no group exists).
    """

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside [0, world_size={self.world_size})")

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelContext:
        """A group of one rank: every collective is a no-op."""
        return cls(rank=0, world_size=1, device=torch.device(device))

    @property
    def is_rank0(self) -> bool:
        """True on the rank that samples and reports tokens."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over all ranks, in place; returns ``x`` (any shape and dtype)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def gather_to_rank0(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim``, in rank order, on rank 0.

        Args:
            x: this rank's part; every rank must pass the same shape and dtype.
            dim: the dimension to concatenate along.

        Returns:
            On rank 0 the concatenation (``x.shape[dim] * world_size`` along
            ``dim``); None on the other ranks.
        """
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        if self.rank != 0:
            dist.gather(x, gather_list=None, dst=dst, group=self.group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.gather(x, gather_list=parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim)


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    device: str | torch.device,
    timeout_s: float,
) -> ParallelContext:
    """Join the tensor-parallel group and return this rank's context.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: tensor-parallel degree.
        init_method: rendezvous URL shared by all ranks, e.g. ``"tcp://10.0.0.1:29500"``.
        device: ``"cpu"`` (gloo backend) or a CUDA device such as ``"cuda:0"`` (NCCL);
            plain ``"cuda"`` means ``cuda:<rank modulo the visible GPUs>``.
        timeout_s: seconds a collective may wait for the other ranks before it fails.

    Returns:
        The context. With ``world_size == 1`` no process group is created and
        ``init_method`` is not contacted.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)`` or ``timeout_s <= 0``.
        RuntimeError / DistStoreError: the rendezvous failed or timed out.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())  # one GPU per rank
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = ParallelContext(rank=rank, world_size=world_size, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        return ctx
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return ctx


def destroy_distributed() -> None:
    """Leave the process group, if one was created (safe to call more than once)."""
    if dist.is_initialized():
        dist.destroy_process_group()
