"""Which device a worker rank computes on: one GPU per rank, picked by its local rank, or the CPU.

Ranks on one host are numbered ``0 .. num_local_ranks - 1`` (the *local rank*;
equal to the global rank on a single host). Local rank ``r`` takes ``cuda:r`` of
the GPUs the process sees (``CUDA_VISIBLE_DEVICES`` applies first). Two ranks
never share a GPU: NCCL refuses two ranks of one communicator on one device, and
they would split its memory. A group that needs more GPUs than the host shows is
refused at start-up with both counts, instead of failing later inside NCCL.

CUDA's *current device* is per thread: every thread that launches work for the
rank (the loading thread, the gRPC threads that run ``InitCache`` and ``Step``)
calls :func:`bind_thread`, or its kernels and allocations would land on
``cuda:0``.
"""

from __future__ import annotations

import os

import torch


def resolve_device(device: str, local_rank: int, num_local_ranks: int) -> torch.device:
    """The device of one rank.

    Args:
        device: ``"auto"`` (CUDA when a GPU is visible, else the CPU), ``"cuda"``,
            ``"cpu"`` or ``"meta"`` (tests).
        local_rank: this rank's index among the ranks of its host, ``0 <= local_rank < num_local_ranks``.
        num_local_ranks: ranks of the group running on this host.

    Returns:
        ``cuda:<local_rank>``, or the CPU (or meta) device.

    Raises:
        ValueError: ``device="cuda"`` with no GPU visible; more local ranks than
            visible GPUs (``device`` ``"cuda"`` or ``"auto"``); a local rank out of
            range. The message names the counts and ``CUDA_VISIBLE_DEVICES``.
    """
    if not 0 <= local_rank < num_local_ranks:
        raise ValueError(f"local_rank={local_rank} is outside [0, num_local_ranks={num_local_ranks})")
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if num_gpus > 0 else "cpu"
    if device != "cuda":
        return torch.device(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    if num_gpus == 0:
        raise ValueError(f"--device cuda, but no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={visible})")
    if num_local_ranks > num_gpus:
        raise ValueError(
            f"{num_local_ranks} ranks on this host need one GPU each, but {num_gpus} "
            f"{'is' if num_gpus == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES={visible}); "
            f"lower --tensor-parallel-size or spread the group over more hosts"
        )
    return torch.device("cuda", local_rank)


def bind_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
