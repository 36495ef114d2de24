"""A rank that is alive but stuck is found by a liveness check, not the step timeout (docs/design/faults.md, "A
liveness check independent of the step").

SIGSTOP of rank 1 mid-stream stands for a hung kernel or a host gone without a
FIN: the process exists, its sockets stay open, it answers nothing. Before, health
stayed SERVING and every request hung for the whole step timeout (120 s by
default), new ones too. Now the coordinator's liveness check (GetStatus every
second, 3 s to answer) declares the group lost: the stream fails with
UNAVAILABLE, health turns NOT_SERVING and new requests are refused, all within 5 s.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.cluster import rank_pids, serve

pytestmark = pytest.mark.e2e

DETECTION_S = 5.0


def _serving(health: health_pb2_grpc.HealthStub) -> bool:
    try:
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return False  # the server has stopped listening: not serving either
    return status == health_pb2.HealthCheckResponse.SERVING


def test_a_stopped_rank_turns_health_not_serving_and_fails_requests_within_5_s() -> None:
    # Recovery off: the fail-fast path (with recovery the requests would pause and resume instead).
    with serve(None, 2, "--worker-recovery-timeout-seconds", "0") as cluster:
        ranks = rank_pids(cluster.process.pid)
        health = health_pb2_grpc.HealthStub(cluster.client.channel)
        stream = cluster.client.generate_stream("Once upon a time", max_tokens=400, temperature=0,
                                                ignore_eos=True, timeout_s=60)
        next(stream)
        os.kill(ranks[1], signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                list(stream)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert "liveness" in failed.value.details()
            assert time.monotonic() - started < DETECTION_S
            while _serving(health):
                assert time.monotonic() - started < DETECTION_S, "health still SERVING"
                time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as refused:  # refused, not hung until the deadline
                cluster.client.generate("Hi", max_tokens=2, timeout_s=3)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert cluster.process.wait(30) == 1  # the orchestrator restarts the group
        finally:
            os.kill(ranks[1], signal.SIGCONT) if _alive(ranks[1]) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
