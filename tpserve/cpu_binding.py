"""Which cores a CPU rank runs on (``--cpu-omp-threads-bind``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND``).

A CPU rank left to the kernel's scheduler migrates between cores and, at tensor-parallel
size 2 and up, shares one with a peer while another core idles: its peers then wait for it in
every all-reduce. Binding each local rank to cores of its own stops both. vLLM's CPU backend
binds by default for the same reason (``VLLM_CPU_OMP_THREADS_BIND=auto``); its values are
kept here:

- ``auto``: where a host runs two ranks or more, each gets ``threads`` consecutive cores of
  those this process may run on (``os.sched_getaffinity``), counted from the last, so that
  the first ones, which no rank takes when the ranks' threads leave some, stay the
  coordinator's. Nothing is bound when the ranks' threads outnumber the cores (binding would
  stack ranks on a core), nor for a host's only rank: it has no peer to keep apart from, and
  bound it could no longer move off a core the coordinator or a client is using to an idle one
  (at tp 1, one thread, 2 cores: TPOT -10 % to +11 % over three runs, no gain to keep).
- ``nobind``: the kernel places the ranks' threads.
- a list per local rank, ``|``-separated, each a Linux cpulist: ``0-3|4-7`` binds local rank
  0 to cores 0-3 and local rank 1 to 4-7 (several servers on one host, NUMA nodes). A rank's
  threads then default to its cores' count.

Measured on a 2-core host, the embedded model, one thread per rank (benchmarks/README.md,
step_overhead): client TPOT 12-19 % lower at tp 2 at 1, 16 and 64 streams, in three runs.

No torch here: the configuration validates the value (tpserve/config.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

AUTO, NOBIND = "auto", "nobind"


def parse_cpulist(text: str) -> frozenset[int]:
    """A Linux cpulist (``0-3,8,10-11``) as a set of core ids.

    Raises:
        ValueError: an empty list, a part that is not ``N`` or ``N-M`` with ``N <= M``, or a
            negative id.
    """
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(f"{text!r} is not a cpulist (e.g. 0-3,8): bad part {part!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"{text!r} is not a cpulist (e.g. 0-3,8): bad range {part!r}")
        cores.update(range(low, high + 1))
    return frozenset(cores)


def parse_bind(value: str) -> str | tuple[frozenset[int], ...]:
    """``--cpu-omp-threads-bind``'s value: ``auto``, ``nobind`` or one cpulist per local rank.

    Raises:
        ValueError: a malformed cpulist, or two ranks' lists that share a core.
    """
    if value in (AUTO, NOBIND):
        return value
    lists = tuple(parse_cpulist(part) for part in value.split("|"))
    taken: set[int] = set()
    for index, cores in enumerate(lists):
        if taken & cores:
            raise ValueError(f"cpu_omp_threads_bind={value!r}: local rank {index}'s cores "
                             f"{sorted(taken & cores)} are another rank's too")
        taken |= cores
    return lists


@dataclass(frozen=True)
class Binding:
    """One rank's placement: ``cores`` (None: left to the kernel) and why, for the log."""

    cores: frozenset[int] | None
    reason: str


def rank_binding(value: str, local_rank: int, local_world_size: int, num_threads: int,
                 allowed: Iterable[int]) -> Binding:
    """The cores local rank ``local_rank`` of ``local_world_size`` binds to (see the module docstring).

    Args:
        value: ``--cpu-omp-threads-bind`` (``auto``, ``nobind`` or per-rank cpulists).
        local_rank: this rank's index among its host's ranks.
        local_world_size: the group's ranks on this host.
        num_threads: intra-op threads of each rank (``torch.get_num_threads()``).
        allowed: the cores this process may run on (``os.sched_getaffinity(0)``).

    Raises:
        ValueError: an explicit list whose number of entries is not ``local_world_size``, or
            whose cores this process may not run on.
    """
    spec = parse_bind(value)
    allowed = sorted(set(allowed))
    if spec == NOBIND:
        return Binding(None, "--cpu-omp-threads-bind nobind")
    if isinstance(spec, tuple):
        if len(spec) != local_world_size:
            raise ValueError(f"--cpu-omp-threads-bind {value!r} names {len(spec)} core lists for "
                             f"{local_world_size} ranks on this host: give one per rank, '|'-separated")
        outside = sorted(spec[local_rank] - set(allowed))
        if outside:
            raise ValueError(f"--cpu-omp-threads-bind {value!r}: local rank {local_rank}'s cores {outside} are "
                             f"not among those this process may run on ({format_cpulist(allowed)})")
        return Binding(spec[local_rank], "--cpu-omp-threads-bind")
    if local_world_size == 1:
        return Binding(None, "the host's only rank")
    needed = local_world_size * num_threads
    if needed > len(allowed):
        return Binding(None, f"{local_world_size} ranks x {num_threads} threads outnumber the {len(allowed)} cores")
    start = len(allowed) - needed + local_rank * num_threads
    return Binding(frozenset(allowed[start:start + num_threads]), "auto")


def default_num_threads(value: str, local_rank: int, local_world_size: int, allowed: Iterable[int]) -> int:
    """A CPU rank's intra-op threads where ``OMP_NUM_THREADS`` is not set: its cores' count with
    explicit lists, else the host's cores (those this process may run on) over its ranks, at
    least 1: ranks never oversubscribe the cores (oversubscribed CPU matmuls slow down by an
    order of magnitude)."""
    spec = parse_bind(value)
    if isinstance(spec, tuple) and len(spec) == local_world_size:
        return len(spec[local_rank])
    return max(1, len(set(allowed)) // local_world_size)


def bind_process(cores: frozenset[int]) -> None:
    """Binds every thread of this process to ``cores``; threads started later inherit it from
    the thread that starts them (Linux ``sched_setaffinity`` is per thread).

    Raises:
        OSError: the kernel refused (a core outside the process's cpuset).
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def format_cpulist(cores: Iterable[int]) -> str:
    """Core ids as a Linux cpulist: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    ids = sorted(set(cores))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)
