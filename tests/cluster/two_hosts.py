"""Two hosts on loopback (ports, timeouts, a launched group, goldens), shared by the multi-host tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.cluster.hosts import (
    command_line,
)
from tests.e2e.cluster import pid_alive
from tests.paths import load_goldens
from tpserve.client import Client

MASTER_PORT = 29500
PUBLIC_PORT = 50051
STEP_TIMEOUT_S = 20
START_TIMEOUT_S = 120
# What Kubernetes injects for Services named "tpserve" and "master": never a port.
SERVICE_LINK_ENV = {"TPSERVE_PORT": "tcp://10.0.0.7:50051", "MASTER_PORT": "tcp://10.0.0.7:29500",
                    "TPSERVE_SERVICE_PORT": "50051", "MASTER_ADDR": "10.0.0.7"}


@dataclass
class Group:
    leader: subprocess.Popen
    headless: subprocess.Popen
    leader_log: Path
    headless_log: Path
    client: Client
    pids: list[int]
    start_headless: Callable[[], subprocess.Popen]  # again, as an orchestrator would (stopped at teardown)

    def worker_pids(self) -> list[int]:
        """The pids of the group's four worker-rank processes, on both hosts."""
        workers = [pid for pid in self.pids if "worker.main" in command_line(pid)]
        assert len(workers) == 4, [command_line(pid) for pid in self.pids]
        return workers

    def rank_pid(self, rank: int) -> int:
        """The pid of the worker process of global ``rank``."""
        for pid in self.pids:
            argv = command_line(pid)
            # each rank is `python -m worker.main --config <dir>/rank<R>.json` (launch/local_ranks.py)
            if "worker.main" in argv and argv[argv.index("--config") + 1].endswith(f"/rank{rank}.json"):
                return pid
        raise LookupError(f"no process for rank {rank} among {self.pids}")


def greedy(client: Client, golden: dict):
    return client.generate(golden["prompt"], max_tokens=golden["max_tokens"], temperature=0)


def assert_matches_golden(result, golden: dict) -> None:
    assert result.token_ids == golden["completion_token_ids"]
    assert result.text == golden["text"]
    assert result.finish_reason == golden["finish_reason"]


def check_goldens_alone(group: Group) -> None:
    for golden in load_goldens():
        assert_matches_golden(greedy(group.client, golden), golden)


def check_goldens_sixteen_at_once(group: Group) -> None:
    goldens = load_goldens()
    batch = [goldens[i % len(goldens)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda g: greedy(group.client, g), batch))
    for result, golden in zip(results, batch):
        assert_matches_golden(result, golden)


def check_a_killed_rank_fails_the_requests_and_stops_the_group(group: Group, rank: int) -> None:
    """SIGKILL of ``rank`` mid-stream: the stream fails (INTERNAL) within a step timeout, both hosts exit 1, no process is left."""
    stream = group.client.generate_stream("Once upon a time", max_tokens=450, temperature=0, ignore_eos=True)
    next(stream)
    os.kill(group.rank_pid(rank), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert time.monotonic() - started < STEP_TIMEOUT_S
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "request req-" in info.value.details() and "failed" in info.value.details()
    assert group.leader.wait(30) == 1
    assert group.headless.wait(30) == 1
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in group.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in group.pids if pid_alive(p)]
