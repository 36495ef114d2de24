"""Ctrl-C or SIGTERM to the whole process group drains like SIGTERM to the coordinator (docs/design/faults.md, "Ranks
leave shutdown to the coordinator").

A terminal's Ctrl-C, a container runtime and ``kill -- -PGID`` signal every process
of the group. The ranks run in a session of their own, so only the coordinator
gets the signal: it stops taking requests, lets in-flight streams finish within
its shutdown grace, then stops the ranks and exits 0. Before, the ranks died at
once and every in-flight request failed with INTERNAL, exit code 1.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from tests.e2e.cluster import rank_pids, pid_alive, serve

pytestmark = pytest.mark.e2e

MAX_TOKENS = 120


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_drains_the_stream_and_exits_zero(signum: signal.Signals, tmp_path) -> None:
    log = tmp_path / "server.log"
    with serve(None, 2, new_session=True, log_path=log) as cluster:
        # A structured-output request first: its grammar-compiler children are in the group too.
        assert cluster.client.generate("Is it?", max_tokens=4, choices=["yes", "no"], timeout_s=60).text in ("yes", "no")
        stream = cluster.client.generate_stream("Once upon a time", max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True, timeout_s=60)
        token_ids = list(next(stream).token_ids)
        os.killpg(cluster.process.pid, signum)  # the server's process group: coordinator (and, before, its ranks)
        last = None
        for chunk in stream:
            token_ids.extend(chunk.token_ids)
            last = chunk
        assert last is not None and last.finish_reason == "length"
        assert len(token_ids) == MAX_TOKENS
        with pytest.raises(grpc.RpcError) as refused:  # no new request once draining
            cluster.client.generate("Hi", max_tokens=1, timeout_s=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert cluster.process.wait(30) == 0
    # Every helper process ignores the terminal's Ctrl-C (the coordinator stops them): no traceback.
    assert "Traceback" not in log.read_text(errors="replace")


def test_ranks_in_their_own_session_still_exit_when_the_coordinator_dies() -> None:
    with serve(None, 2) as cluster:
        ranks = rank_pids(cluster.process.pid)
        assert len(ranks) == 2 and all(os.getsid(pid) == pid for pid in ranks)  # each leads its own session
        cluster.process.kill()  # SIGKILL: no drain, no SIGTERM to the ranks
        cluster.process.wait(10)
        deadline = time.monotonic() + 5  # worker/main.py checks its parent every second
        while any(pid_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(pid) for pid in ranks)


def test_the_grace_is_the_flag() -> None:
    """A stream longer than --shutdown-grace-seconds is cut when the grace ends; the server still exits 0.
    450 tokens take 0.45-0.9 s at tp 2 on this host: a grace of 0.1 s cuts them (0.5 s no longer did)."""
    with serve(None, 2, "--shutdown-grace-seconds", "0.1") as cluster:
        stream = cluster.client.generate_stream("Once upon a time", max_tokens=450, temperature=0,
                                                ignore_eos=True, timeout_s=120)
        next(stream)
        started = time.monotonic()
        cluster.process.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert time.monotonic() - started < 10  # cut at the grace, not after 450 tokens
        # Said why (before: gRPC's own "Cancelling all calls").
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the server shut down: its --shutdown-grace-seconds (0.1 s) ended before the request did" in \
            info.value.details(), info.value.details()
        assert cluster.process.wait(30) == 0


def test_a_health_watch_on_the_public_port_does_not_hold_the_drain() -> None:
    """A Watch never ends by itself and gRPC's graceful stop waits for every call: one watcher on the public
    port held an idle server's SIGTERM for the whole grace (10.1 s of 10). It now ends with UNAVAILABLE, after
    the readiness NOT_SERVING the drain sets first, and the server exits at once."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with serve(None, 1, "--shutdown-grace-seconds", "20") as cluster:
        stub = health_pb2_grpc.HealthStub(cluster.client.channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        cluster.process.send_signal(signal.SIGTERM)
        statuses = []
        with pytest.raises(grpc.RpcError) as ended:
            for answer in watch:
                statuses.append(answer.status)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert cluster.process.wait(30) == 0
        assert time.monotonic() - started < 5, "the drain waited for the health Watch"
