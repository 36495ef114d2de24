"""All-reduce and gather between the CPU ranks of one host, through shared memory.

Why: a gloo all-reduce between two local processes costs about 0.4 ms whatever
its size (TCP loopback, several syscalls and wake-ups each way), and a Llama
step issues ``2 * num_layers + 1`` of them: 25 ms per step for a 30-layer model,
more than its arithmetic. Ranks on one host can exchange activations through
memory they share instead (vLLM's CPU backend does the same, in C++); a small
collective then costs two memory copies and a few microseconds of polling.

Protocol (one segment per tensor-parallel group, mapped by every rank):

    flags:  num_ranks int64 counters, one per cache line (no false sharing)
    slots:  2 buffers x num_ranks slots x ``max_bytes`` bytes

Collective number ``seq`` (1, 2, ...; every rank issues the same sequence, as
with any collective) uses buffer ``seq % 2``. Each rank copies its tensor into
its own slot, publishes ``flags[rank] = seq``, waits until every flag is
``>= seq``, then reads the slots. Double buffering makes one wait per collective
enough: a rank writes buffer ``seq % 2`` again only at ``seq + 2``, after it saw
every flag reach ``seq + 1``, which a rank publishes only after it finished
reading collective ``seq``.

Every rank sums the slots in rank order, so all ranks hold bitwise-identical
results (as with gloo and NCCL), and for two ranks the result equals gloo's
exactly (``a + b == b + a`` in IEEE arithmetic).

Ordering: the data copy is made before the flag store, and a reader loads the
flag before the data. x86-64's memory model (TSO) keeps stores in program order
and loads in program order, which is what this relies on; the module refuses
other architectures (they would need explicit fences, which Python cannot emit).

Waiting: a rank polls the flags for a few hundred microseconds (a peer running
on its own core arrives within that), then sleeps in the kernel on the late
peer's flag word with ``futex(FUTEX_WAIT)``, and every rank wakes the sleepers
of its own flag after publishing it (``FUTEX_WAKE``). Pure spinning is fast on
idle cores but collapses when ranks outnumber free cores (a descheduled peer
makes every waiter burn its time slice): each collective would then cost a
scheduler round trip. The futex compares the flag inside the kernel, so a wake
that races the sleep is never lost, and every sleep is bounded (``_SLEEP_S``) so
the timeout and the liveness checks below still run.

Compiled path: where tpserve's CPU kernels are built on every rank
(worker/kernels/cpu_shm.cpp), one collective is one call into C++ that copies,
publishes, spins on the flags with ``pause`` and sums with vector instructions;
it wakes sleepers only when a peer announced that it sleeps, so the usual
collective makes no system call. That costs a few microseconds instead of the
Python version's 15-30; the group picks one version for all its ranks. A compiled caller may run a group's
collectives itself: the CPU decode region on tensor-parallel ranks sums each layer's partial products inside
its parallel region (worker/kernels/shm_collective.h, :meth:`SharedMemoryComm.compiled_group`), numbering them
from :attr:`SharedMemoryComm.next_collective` and checking the peers as :meth:`SharedMemoryComm._check_peers`
does; Python then :meth:`SharedMemoryComm.skip` s past them.

A peer that stops publishing makes the wait fail after ``timeout_s`` with a
``RuntimeError`` ("Timed out ..."), the same failure as gloo's collective
timeout, so a lost rank fails the step instead of hanging it. A peer process
that has exited fails the wait within milliseconds (the waiting rank checks the
late peers' pids while it polls), as gloo's closed connection does.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import time
from pathlib import Path

import torch

#: Bytes between two ranks' flags: one cache line each.
_FLAG_STRIDE = 64
#: Polls of the flags before the waiting rank sleeps (a few hundred microseconds).
_SPIN_POLLS = 300
#: Longest single futex sleep, seconds: the timeout and liveness checks run between sleeps.
_SLEEP_S = 0.02
#: Compiled path: seconds a rank spins on a late peer's flag before it sleeps. Long enough to cover
#: the skew between ranks on idle cores (a few to tens of microseconds); short enough that a rank
#: sharing its core with a descheduled peer gives the core up quickly.
_SPIN_S = 200e-6
# Linux x86-64: syscall number of futex(2), its operations (shared, not PRIVATE: the
# word lives in memory mapped by several processes), and the errno of a timed-out wait.
_SYS_FUTEX = 202
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def supported() -> bool:
    """True where the protocol's memory-ordering assumption holds (x86-64) and /dev/shm exists."""
    return platform.machine().lower() in ("x86_64", "amd64") and Path("/dev/shm").is_dir()


def segment_bytes(num_ranks: int, max_bytes: int) -> int:
    """Size of the shared segment in bytes for ``num_ranks`` ranks and ``max_bytes`` per slot."""
    return num_ranks * _FLAG_STRIDE + 2 * num_ranks * max_bytes


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is running (an exited process not yet reaped is a zombie: dead)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
    except (PermissionError, OSError):
        return True  # exists, but not ours to inspect


class SharedMemoryComm:
    """Collectives among the ``num_ranks`` ranks of one host over a shared file in /dev/shm.

    Args:
        path: the segment's file; rank 0 creates it (``create=True``) before the
            others open it, and anyone may unlink it once all have mapped it.
        rank: this rank, ``0 <= rank < num_ranks``.
        num_ranks: ranks in the group (all on this host).
        max_bytes: largest tensor (bytes) a collective may carry; callers fall
            back to gloo for larger ones (:meth:`fits`).
        timeout_s: seconds a collective waits for its peers before failing.
        create: create and size the file (rank 0 only).
        peer_pids: process id of each rank (same host), to notice a peer that
            exited without waiting for the timeout; None: rely on the timeout.
        compiled: use the compiled collective (``torch.ops.tpserve_cpu.shm_collective``);
            every rank of the group must pass the same value.

    Raises:
        RuntimeError: not on x86-64 (see the module docstring).
        OSError: the file cannot be created, opened or mapped.
    """

    def __init__(self, path: str | Path, rank: int, num_ranks: int, max_bytes: int, timeout_s: float,
                 *, create: bool, peer_pids: list[int] | None = None, compiled: bool = False) -> None:
        if not supported():
            raise RuntimeError(f"shared-memory collectives need x86-64 and /dev/shm, not {platform.machine()}")
        self.rank = rank
        self.num_ranks = num_ranks
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.peer_pids = peer_pids
        self.compiled = compiled
        size = segment_bytes(num_ranks, max_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled: every flag starts at 0
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # Flags as Python-readable int64s (a memoryview index costs ~50 ns, a tensor .item() ~1 us).
        self._flags = memoryview(self._map)[: num_ranks * _FLAG_STRIDE].cast("q")
        self._flag_index = [r * _FLAG_STRIDE // 8 for r in range(num_ranks)]
        # The low 32 bits of each flag (little-endian) are its futex word.
        self._anchor = ctypes.c_char.from_buffer(self._map)  # keeps the mapping's address valid
        base = self._base = ctypes.addressof(self._anchor)
        self._futex_addr = [ctypes.c_void_p(base + r * _FLAG_STRIDE) for r in range(num_ranks)]
        self._sleep = _Timespec(0, int(_SLEEP_S * 1e9))
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=num_ranks * _FLAG_STRIDE,
                                count=2 * num_ranks * max_bytes)
        self._slots = data.view(2, num_ranks, max_bytes)  # (buffer, rank, bytes)
        self._views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        self._seq = 0

    def compiled_group(self) -> tuple:
        """The segment as a compiled caller takes it (``DecodeLayers.set_group``, worker/kernels/shm_collective.h):
        ``(address, rank, num_ranks, max_bytes, spin_s, sleep_s, timeout_s, peer_pids)``. Such a caller runs
        collectives :attr:`next_collective`, ``+ 1``, .. itself, then :meth:`skip` s them."""
        return (self._base, self.rank, self.num_ranks, self.max_bytes, _SPIN_S, _SLEEP_S, self.timeout_s,
                list(self.peer_pids or ()))

    @property
    def next_collective(self) -> int:
        """The number the next collective takes (1, 2, ...: the protocol's ``seq``)."""
        return self._seq + 1

    def skip(self, n: int) -> None:
        """Counts ``n`` collectives that a compiled caller ran itself (:meth:`compiled_group`). Every rank skips
        the same ``n`` at the same point of its sequence, as it would have called :meth:`all_reduce` ``n`` times."""
        self._seq += n

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can go through shared memory (a CPU tensor of at most ``max_bytes``)."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.max_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place, in rank order; returns ``x``.

        Args:
            x: any shape and dtype, on the CPU, ``fits(x)``; the same shape and dtype on every rank.

        Raises:
            RuntimeError: a peer did not arrive within ``timeout_s``.
        """
        if self.compiled:
            flat = x if x.is_contiguous() else x.contiguous()
            self._seq += 1
            self._compiled_collective(flat, reduce=True)
            if flat.data_ptr() != x.data_ptr():
                x.copy_(flat)
            return x
        slots = self._exchange(x)  # num_ranks flat views of x's dtype
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        flat.copy_(slots[0])
        for other in slots[1:]:
            flat.add_(other)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order (a new tensor on every rank).

        Raises:
            RuntimeError: a peer did not arrive within ``timeout_s``.
        """
        parts = [s.view(x.shape) for s in self._exchange(x)]
        return torch.cat(parts, dim=dim)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x`` in this rank's slot, wait for every rank, return all slots as flat ``x.dtype`` views."""
        self._seq += 1
        seq = self._seq
        if self.compiled:
            self._compiled_collective(x.contiguous(), reduce=False)
            return self._slot_views(seq, x)
        views = self._slot_views(seq, x)
        views[self.rank].view(x.shape).copy_(x)
        self._flags[self._flag_index[self.rank]] = seq  # after the data: TSO keeps the order
        _libc.syscall(_SYS_FUTEX, self._futex_addr[self.rank], _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
        self._wait(seq)
        return views

    def _compiled_collective(self, x: torch.Tensor, *, reduce: bool) -> None:
        """Collective ``self._seq`` in C++ (contiguous ``x``; summed in place with ``reduce``)."""
        seq, op = self._seq, torch.ops.tpserve_cpu.shm_collective
        deadline = time.monotonic() + self.timeout_s
        publish = True
        # Each call waits at most _SLEEP_S, so the liveness and timeout checks run between calls.
        while not op(x, self._base, self.rank, self.num_ranks, self.max_bytes, seq, publish, reduce,
                     _SPIN_S, _SLEEP_S):
            publish = False
            self._check_peers(seq, deadline)

    def _slot_views(self, seq: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of collective ``seq`` as a flat view of ``x``'s dtype and size."""
        key = (seq & 1, x.numel(), x.dtype)
        views = self._views.get(key)
        if views is None:  # a step reuses a handful of (size, dtype) pairs: build their views once
            nbytes = x.numel() * x.element_size()
            buffer = self._slots[seq & 1]  # (num_ranks, max_bytes) uint8
            views = self._views[key] = [buffer[r, :nbytes].view(x.dtype) for r in range(self.num_ranks)]
        return views

    def _check_peers(self, seq: int, deadline: float) -> list[int]:
        """The ranks whose flag is still below ``seq``.

        Raises:
            RuntimeError: one of them has exited, or ``deadline`` (time.monotonic) has passed.
        """
        late = [r for r, i in enumerate(self._flag_index) if self._flags[i] < seq]
        exited = [r for r in late if self.peer_pids and not _alive(self.peer_pids[r])]
        if exited:
            raise RuntimeError(f"ranks {exited} exited during shared-memory collective {seq} (rank {self.rank})")
        if late and time.monotonic() > deadline:
            raise RuntimeError(
                f"Timed out after {self.timeout_s:.1f} s waiting for ranks {late} in shared-memory "
                f"collective {seq} (rank {self.rank})")
        return late

    def _wait(self, seq: int) -> None:
        flags, index = self._flags, self._flag_index
        for _ in range(_SPIN_POLLS):
            if all(flags[i] >= seq for i in index):
                return
        deadline = time.monotonic() + self.timeout_s
        while True:
            late = self._check_peers(seq, deadline)
            if not late:
                return
            # Sleep until the first late peer's flag word changes (returns at once if it already has).
            r = late[0]
            seen = flags[index[r]] & 0xFFFFFFFF
            seen = seen - (1 << 32) if seen >= 1 << 31 else seen  # the word as a C int
            _libc.syscall(_SYS_FUTEX, self._futex_addr[r], _FUTEX_WAIT, ctypes.c_int(seen),
                          ctypes.byref(self._sleep), None, 0)

    def close(self) -> None:
        """Unmap the segment (tensors that view it must no longer be used)."""
        self._flags.release()
        self._slots = None  # type: ignore[assignment]
        self._views.clear()
        self._anchor = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a tensor still views the map; the OS unmaps it at exit
            pass
