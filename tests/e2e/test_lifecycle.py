"""Start-up refusal, clean shutdown, and a lost rank: no crash, no hang, no process left.

What a lost rank does, per backend (docs/design/gpu.md, "NCCL failures"):

* gloo (CPU, these tests): a collective whose peer died fails at once (its TCP
  connection closes) or at the group's timeout (a hung peer); the step's error
  path reports it to the coordinator.
* NCCL (CUDA, not run here): collectives are asynchronous, so the step's Python
  code does not see the failure; PyTorch's watchdog aborts the rank process at
  the group's timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, set by
  worker/nccl_env.py, after a flight-recorder dump).
* Both: the coordinator watches its rank processes and treats any exit as a lost
  group: in-flight requests fail at once (INTERNAL or UNAVAILABLE), health turns
  NOT_SERVING, the coordinator stops the other ranks and exits 1. That path is
  what ``test_a_lost_rank_fails_requests_and_stops_the_cluster`` checks, and it is
  the same on both backends.
"""

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
        [sys.executable, "-m", "launch.cli", "serve", "--model", str(STORIES_DIR), "--tensor-parallel-size", "8",
         "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "intermediate_size=172" in out.stderr and "--tensor-parallel-size=8" in out.stderr


def test_sigterm_stops_every_process_with_exit_code_zero() -> None:
    with serve(STORIES_DIR, 2) as cluster:
        workers = child_pids(cluster.process.pid)
        assert len(workers) == 2
        assert cluster.client.generate("Hi", max_tokens=3, temperature=0).finish_reason == "length"
    assert cluster.process.returncode == 0
    assert not any(pid_alive(pid) for pid in workers)


def test_a_lost_rank_fails_requests_and_stops_the_cluster() -> None:
    """SIGKILL of rank 1 mid-stream: the stream fails within 10 s, the coordinator exits 1.

    gloo: rank 0's next collective fails too; NCCL: rank 0 may hang until its watchdog
    fires, but the coordinator has already seen rank 1's exit, so the client sees the
    same failure within the same bound, and rank 0 is stopped with the group.
    """
    # Recovery off: this is the exit-for-the-orchestrator path (tests/e2e/test_recovery.py has the other).
    with serve(STORIES_DIR, 2, "--distributed-timeout-seconds", "10", "--worker-recovery-timeout-seconds", "0") as cluster:
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


def test_health_is_not_serving_and_requests_unavailable_until_every_rank_has_loaded() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tpserve.client import Client, RetryPolicy
    from tpserve.stream_move import MovePolicy

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--model", str(STORIES_DIR),
                                "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port", str(port)])
    statuses, early_errors, liveness = [], [], []
    try:
        with Client(f"127.0.0.1:{port}", move_policy=MovePolicy(max_moves=0),
                    retry_policy=RetryPolicy(max_attempts=1)) as client:  # the loading status itself, not retried
            health = health_pb2_grpc.HealthStub(client.channel)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service="tpserve.v1.Generation"), timeout=2).status
                except grpc.RpcError:
                    time.sleep(0.05)  # not listening yet
                    continue
                statuses.append(status)
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                if not early_errors:
                    with pytest.raises(grpc.RpcError) as info:
                        client.generate("Hi", max_tokens=2)
                    early_errors.append(info.value)
                    # Loading is alive: the liveness probe's service answers SERVING from the first answer on.
                    liveness.append(health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2).status)
                time.sleep(0.05)
            assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING  # ranks take seconds to load
            assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING
            assert early_errors[0].code() == grpc.StatusCode.UNAVAILABLE and "loading" in early_errors[0].details()
            assert liveness == [health_pb2.HealthCheckResponse.SERVING]
            assert client.generate("Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0


def test_a_second_server_on_a_port_in_use_is_refused(shared_servers) -> None:
    """gRPC binds with SO_REUSEPORT by default: two servers would share the port and split the clients."""
    cluster = shared_servers.get(None, 1)
    second = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve", "--host", "127.0.0.1", "--port", str(cluster.port)],
        capture_output=True, text=True, timeout=120)
    assert second.returncode != 0
    assert f"cannot bind 127.0.0.1:{cluster.port}" in second.stderr + second.stdout
    assert cluster.client.model_info().model_name == "tpserve-tiny-stories"  # the first still serves
