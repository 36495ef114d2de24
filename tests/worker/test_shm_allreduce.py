"""Shared-memory collectives against gloo's, on random tensors of every dtype and odd sizes.

Each rank is a new process (forked from a server that has imported torch: tests/worker/rank_processes.py); every collective is issued twice, once through the
group's shared memory (``ParallelContext.all_reduce``) and once through gloo
(``dist.all_reduce`` directly), and rank 0 records the differences.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.worker.rank_processes import spawn_ranks
from tests.worker.tp_harness import _free_port
from worker.comm import shm_allreduce
from worker.kernels import cpu_kernels_available
from worker.parallel_state import SHM_MAX_BYTES, destroy_distributed, init_distributed

pytestmark = pytest.mark.skipif(not shm_allreduce.supported(), reason="shared-memory collectives need x86-64 and /dev/shm")

#: Both versions of the protocol: compiled (worker/kernels/cpu_shm.cpp) and Python. The ranks get the
#: test's environment (spawn_ranks), so they see the switch (worker/kernels/__init__.py).
VERSIONS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
#: Odd element counts: one element, not a multiple of any vector width, a decode row, one over a page.
SIZES = (1, 7, 513, 4099, 3 * 5 * 7 * 11 * 13)


def _compare_main(rank: int, world_size: int, init_method: str, out_path: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(rank, world_size, init_method, "cpu", 30.0)
    report: dict = {"shm": ctx.shm is not None, "compiled": ctx.shm is not None and ctx.shm.compiled, "cases": []}
    for dtype in DTYPES:
        for size in SIZES:
            g = torch.Generator().manual_seed(1000 * rank + size)
            x = (torch.randn(size, generator=g) * 50).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)  # gloo
            exact = x.double()
            dist.all_reduce(exact)  # the float64 sum, to bound rounding
            magnitude = x.double().abs()
            dist.all_reduce(magnitude)  # sum of |addends|: what rounding errors scale with
            got = ctx.all_reduce(x.clone())
            report["cases"].append((str(dtype), size, got, expected, exact, magnitude))
    # Shapes other than flat, non-contiguous input, and the logits gather.
    m = torch.arange(12.0).view(3, 4).t() + rank  # (4, 3), not contiguous
    report["strided"] = ctx.all_reduce(m.clone())
    report["gathered"] = ctx.gather_to_rank0(torch.full((2, 3), float(rank)), dim=-1)
    # Larger than the slots: must fall back to gloo and still be right.
    big = torch.ones(SHM_MAX_BYTES // 4 + 1)
    report["big"] = float(ctx.all_reduce(big)[-1])
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(report, f)
    destroy_distributed()


def _run(world_size: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.pkl")
        spawn_ranks(_compare_main, (world_size, f"tcp://127.0.0.1:{_free_port()}", out), nprocs=world_size)
        return pickle.loads(Path(out).read_bytes())


def _use(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if compiled and not cpu_kernels_available():
        pytest.skip("tpserve's CPU kernels did not build here (needs AVX2 and a C++ compiler)")
    monkeypatch.setenv("TPSERVE_CPU_KERNELS", "1" if compiled else "0")


@VERSIONS
@pytest.mark.parametrize("world_size", [2, 4])
def test_shared_memory_all_reduce_equals_gloo(world_size: int, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(compiled, monkeypatch)
    report = _run(world_size)
    assert report["shm"], "ranks on one host did not get shared-memory collectives"
    assert report["compiled"] == compiled
    for dtype, size, got, expected, exact, magnitude in report["cases"]:
        assert got.dtype == expected.dtype and got.shape == expected.shape
        if world_size == 2 or not got.dtype.is_floating_point:
            # Two addends commute exactly in IEEE arithmetic; integers always do.
            assert torch.equal(got, expected), (dtype, size)
        else:
            # Different summation order than gloo's: both within a few roundings of the exact sum.
            eps = torch.finfo(got.dtype).eps
            bound = world_size * eps * magnitude
            assert ((got.double() - exact).abs() <= bound).all(), (dtype, size)
            assert ((expected.double() - exact).abs() <= bound).all(), (dtype, size)
    ranks = torch.arange(world_size, dtype=torch.float32)
    assert torch.equal(report["strided"], (torch.arange(12.0).view(3, 4).t() * world_size + ranks.sum()))
    assert torch.equal(report["gathered"], ranks.repeat_interleave(3).expand(2, -1))
    assert report["big"] == world_size


def test_no_segment_file_outlives_the_group() -> None:
    before = set(os.listdir("/dev/shm"))
    _run(2)
    assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("tpserve-")}


def _lost_peer_main(rank: int, init_method: str, out_path: str, timeout_s: float, hang: bool) -> None:
    """Rank 1 hangs (alive, publishes nothing) or exits after one collective; rank 0 records its next one."""
    ctx = init_distributed(rank, 2, init_method, "cpu", timeout_s)
    ctx.all_reduce(torch.ones(4))
    if rank == 1:
        if hang:  # alive and silent until rank 0 has its outcome (or long past its timeout)
            deadline = time.monotonic() + timeout_s + 2.5
            while not Path(out_path).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        os._exit(0)  # gone (its parent reaps it), never publishes again
    start = time.monotonic()
    try:
        ctx.all_reduce(torch.ones(4))
        outcome = "returned"
    except RuntimeError as exc:
        outcome = str(exc)
    Path(out_path).write_text(f"{time.monotonic() - start}\n{outcome}")
    os._exit(0)


def _lose_peer(timeout_s: float, hang: bool) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.txt")
        spawn_ranks(_lost_peer_main, (f"tcp://127.0.0.1:{_free_port()}", out, timeout_s, hang), nprocs=2)
        seconds, outcome = Path(out).read_text().split("\n", 1)
    return float(seconds), outcome


@VERSIONS
def test_a_hung_peer_times_out(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(compiled, monkeypatch)
    seconds, outcome = _lose_peer(1.5, hang=True)
    assert outcome.startswith("Timed out") and "ranks [1]" in outcome, outcome
    assert 1.0 <= seconds < 4.0


@VERSIONS
def test_an_exited_peer_fails_the_collective_at_once(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead peer is noticed from its pid, long before the 30 s collective timeout."""
    _use(compiled, monkeypatch)
    seconds, outcome = _lose_peer(30.0, hang=False)
    assert outcome.startswith("ranks [1] exited"), outcome
    assert seconds < 5.0


def _stress_main(rank: int, init_method: str, out_path: str) -> None:
    """Back-to-back collectives of changing sizes; rank 1 is late by 2 ms every 25th, so rank 0 sleeps."""
    torch.set_num_threads(1)
    ctx = init_distributed(rank, 2, init_method, "cpu", 30.0)
    wrong, late_waits = 0, []
    for i in range(1, 501):
        late = i % 25 == 0
        if late and rank == 1:
            time.sleep(0.002)  # past the spin: rank 0 must be woken from its futex sleep
        x = torch.full((1 + (i * 37) % 3000,), float(i * (rank + 1)))
        start = time.monotonic()
        ctx.all_reduce(x)
        if late:
            late_waits.append(time.monotonic() - start)
        wrong += int(not torch.equal(x, torch.full_like(x, float(i * 3))))
    if rank == 0:
        Path(out_path).write_text(f"{wrong}\n{' '.join(map(str, late_waits))}")
    destroy_distributed()


@VERSIONS
def test_back_to_back_collectives_and_late_peers_are_woken(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """500 collectives, each buffer reused every other one; 20 of them find the peer 2 ms late.

    A lost wake-up would cost the waiter its whole futex sleep (shm_allreduce._SLEEP_S, 20 ms) instead of ~2 ms.
    """
    _use(compiled, monkeypatch)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.txt"
        spawn_ranks(_stress_main, (f"tcp://127.0.0.1:{_free_port()}", str(out)), nprocs=2)
        wrong, waits = out.read_text().split("\n")
    waits = [float(w) for w in waits.split()]
    assert int(wrong) == 0
    assert len(waits) == 20
    # Median: one slow wake on a busy machine is noise; a lost wake-up is every one of them.
    assert sorted(waits)[10] < shm_allreduce._SLEEP_S * 0.75, waits
