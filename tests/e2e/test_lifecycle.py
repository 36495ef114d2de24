"""Start-up refusal, clean shutdown, and a lost rank: no crash, no hang, no process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from tests.e2e.cluster import child_pids, free_port, pid_alive, serve
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]


def test_a_model_that_cannot_be_split_is_refused_at_start_up() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tpserve.cli", "serve", "--model", str(STORIES_DIR), "--tensor-parallel-size", "8",
         "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "intermediate_size=172" in out.stderr and "tensor_parallel_size=8" in out.stderr


def test_sigterm_stops_every_process_with_exit_code_zero() -> None:
    with serve(STORIES_DIR, 2) as cluster:
        workers = child_pids(cluster.process.pid)
        assert len(workers) == 2
        assert cluster.client.generate("Hi", max_tokens=3, temperature=0).finish_reason == "length"
    assert cluster.process.returncode == 0
    assert not any(pid_alive(pid) for pid in workers)


def test_a_lost_rank_fails_requests_and_stops_the_cluster() -> None:
    with serve(STORIES_DIR, 2, "--distributed-timeout-seconds", "10") as cluster:
        workers = child_pids(cluster.process.pid)
        stream = cluster.client.generate_stream("Once upon a time", max_tokens=450, temperature=0, ignore_eos=True)
        next(stream)
        os.kill(workers[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - started < 10  # failed at once, not at the collective timeout
        cluster.process.wait(30)  # the coordinator stops by itself
        assert cluster.process.returncode == 1
    assert not any(pid_alive(pid) for pid in workers)
