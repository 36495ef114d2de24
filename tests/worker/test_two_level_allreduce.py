"""The two-level all-reduce of a group spread over hosts, against gloo's flat one and the exact sum.

The ranks run on this machine; each is told which "host" it is on by replacing
``worker.parallel_state._host_identity`` in its own process before it joins (the one input
host detection has), so the layouts of several hosts run here: 2 + 2 ranks, 2 + 1, and
interleaved (ranks 0 and 2 on one host, 1 and 3 on the other, so the leaders are 0 and 1).
The real two-host group (network namespaces, stories260k's goldens at tp 4) is
tests/cluster/test_two_hosts.py.
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

import worker.parallel_state as parallel_state
from tests.worker.rank_processes import spawn_ranks
from tests.worker.tp_harness import _free_port
from worker.comm import shm_allreduce
from worker.parallel_state import SHM_MAX_BYTES, destroy_distributed, init_distributed

pytestmark = pytest.mark.skipif(not shm_allreduce.supported(), reason="shared-memory collectives need x86-64 and /dev/shm")

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
SIZES = (1, 513, 3 * 5 * 7 * 11 * 13)


def _join(rank: int, hosts: str, init_method: str, timeout_s: float) -> parallel_state.ParallelContext:
    parallel_state._host_identity = lambda: f"host-{hosts[rank]}/boot"  # type: ignore[assignment]
    torch.set_num_threads(1)
    return init_distributed(rank, len(hosts), init_method, "cpu", timeout_s)


def _compare_main(rank: int, hosts: str, init_method: str, out_dir: str) -> None:
    ctx = _join(rank, hosts, init_method, 30.0)
    report: dict = {"shm": ctx.shm is not None, "two_level": ctx.two_level is not None,
                    "leader": ctx.two_level is not None and ctx.two_level.leaders is not None, "cases": []}
    for dtype in DTYPES:
        for size in SIZES:
            g = torch.Generator().manual_seed(1000 * rank + size)
            x = (torch.randn(size, generator=g) * 50).to(dtype)
            exact = x.double()
            dist.all_reduce(exact)
            magnitude = x.double().abs()
            dist.all_reduce(magnitude)
            report["cases"].append((str(dtype), size, ctx.all_reduce(x.clone()), exact, magnitude))
    big = torch.ones(SHM_MAX_BYTES // 4 + 1)  # past the shared slots: flat gloo
    report["big"] = float(ctx.all_reduce(big)[-1])
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(report))
    destroy_distributed()


def _run(hosts: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_compare_main, (hosts, f"tcp://127.0.0.1:{_free_port()}", tmp), nprocs=len(hosts))
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(len(hosts))]


@pytest.mark.parametrize("hosts", ["aabb", "aab", "abab"], ids=["2+2", "2+1", "interleaved"])
def test_two_level_all_reduce_is_the_sum_and_identical_on_every_rank(hosts: str) -> None:
    reports = _run(hosts)
    assert [r["shm"] for r in reports] == [False] * len(hosts)
    assert [r["two_level"] for r in reports] == [True] * len(hosts)
    # Each host's lowest rank leads it.
    assert [r["leader"] for r in reports] == [hosts.index(h) == i for i, h in enumerate(hosts)]
    for case in range(len(reports[0]["cases"])):
        dtype, size, got, exact, magnitude = reports[0]["cases"][case]
        for other in reports[1:]:
            assert torch.equal(other["cases"][case][2], got), (dtype, size)  # bitwise, as gloo and NCCL give
        if got.dtype.is_floating_point:
            bound = len(hosts) * torch.finfo(got.dtype).eps * magnitude
            assert ((got.double() - exact).abs() <= bound).all(), (dtype, size)
        else:
            assert torch.equal(got.double(), exact), (dtype, size)
    assert [r["big"] for r in reports] == [float(len(hosts))] * len(hosts)


def _lost_rank_main(rank: int, hosts: str, init_method: str, out_dir: str) -> None:
    """Rank 3 (not a leader) exits after one collective; every other rank records its next one."""
    ctx = _join(rank, hosts, init_method, 30.0)
    ctx.all_reduce(torch.ones(4))
    if rank == 3:
        os._exit(0)
    start = time.monotonic()
    try:
        ctx.all_reduce(torch.ones(4))
        outcome = "returned"
    except RuntimeError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"{rank}.txt").write_text(f"{time.monotonic() - start}\n{outcome}")
    os._exit(0)  # as a rank does after a failed step: its exit is what its peers notice next


def test_a_lost_rank_fails_every_rank_long_before_the_timeout() -> None:
    """Rank 3's host leader fails at once (its pid is checked), the other leader when that one exits (gloo's
    closed connection), and rank 1 when its own leader exits: nobody waits for the 30 s timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_lost_rank_main, ("aabb", f"tcp://127.0.0.1:{_free_port()}", tmp), nprocs=4)
        outcomes = {r: Path(tmp, f"{r}.txt").read_text().split("\n", 1) for r in (0, 1, 2)}
    for rank, (seconds, outcome) in outcomes.items():
        assert outcome != "returned", rank
        assert float(seconds) < 10.0, (rank, seconds, outcome)
    assert "ranks [1] exited" in outcomes[2][1]  # rank 3 is rank 1 of host b's segment
    assert "ranks [0] exited" in outcomes[1][1]  # its leader, rank 0
