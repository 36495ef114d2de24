"""A lost rank costs no request: the coordinator restarts the group and resumes every stream by recompute.

With ``--worker-recovery-timeout-seconds``, ``kill -9`` of a rank during a load of
8 greedy and 4 seeded sampled streams (tp 2, the embedded model) must leave every
stream complete and token for token equal to its solo run; the same again for the
other rank (each rank in turn, two restarts in a row). A group that cannot come
back (its checkpoint vanished) fails the held requests with UNAVAILABLE naming
the reason, and the server exits 1. A replacement rank killed while the group restarts
(docs/design/faults.md, "A second failure during a restart") makes the leader try again at once, or, after the last
attempt, exit
within seconds naming the rank, the host and the cause. While the group restarts, the health port answers
readiness ("") NOT_SERVING and liveness ("liveness", the manifests' liveness probe) SERVING: a kubelet
must not restart a leader that holds requests for its group.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launch.public_server import LIVENESS_SERVICE
from tests.e2e.cluster import free_port, serve
from tests.e2e.recovery import MAX_TOKENS, _kill_during_load, _rank_pid, _requests
from tpserve.embedded_model import default_model_dir

pytestmark = pytest.mark.e2e

RECOVERY = ("--worker-recovery-timeout-seconds", "90")


def _kill_replacements(server_pid: int, rank: int, killed_pid: int, num: int, timeout_s: float = 60.0) -> list[int]:
    """Kills (SIGKILL) the next ``num`` processes of ``rank`` after ``killed_pid`` as each appears: the
    replacements a restart starts, killed while the group loads. Returns their pids (fewer if
    ``timeout_s`` passes)."""
    seen = {killed_pid}
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while len(killed) < num and time.monotonic() < deadline:
        try:
            pid = _rank_pid(server_pid, rank)
        except (LookupError, OSError, ValueError):  # between two launches, or a process just gone
            pid = None
        if pid is not None and pid not in seen:
            os.kill(pid, signal.SIGKILL)
            seen.add(pid)
            killed.append(pid)
        time.sleep(0.02)
    return killed


@pytest.mark.parametrize("extra", [(), ("--async-scheduling",)], ids=["sync", "async"])
def test_kill_9_of_each_rank_in_turn_loses_no_request(extra: tuple[str, ...]) -> None:
    """With async scheduling two steps are in flight when a rank dies: both are void, and the
    streams still resume token for token."""
    requests = _requests()
    with serve(None, 2, *RECOVERY, *extra) as cluster:
        solo = [cluster.client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, **s).token_ids for p, s in requests]
        pauses = []
        for restarts, rank in enumerate((1, 0), start=1):
            results = _kill_during_load(cluster, rank, requests)
            for (prompt, sampling), result, expected in zip(requests, results, solo, strict=True):
                assert "error" not in result, f"rank {rank}: {prompt!r} {sampling}: {result.get('error')}"
                assert result["tokens"] == expected, f"rank {rank}: {prompt!r} {sampling} differs from its solo run"
            pauses.append(max(r["longest_pause_s"] for r in results))
            cluster.client.wait_ready(timeout_s=30)  # SERVING again
            assert cluster.metric("tpserve:worker_restarts_total") == restarts
        assert cluster.metric("tpserve:requests_resumed_total") >= 1
        assert cluster.metric("tpserve:kv_cache_free_blocks") == cluster.metric("tpserve:kv_cache_total_blocks")
        print(f"longest pause a client saw per restart: {[round(p, 2) for p in pauses]} s")


def test_a_group_that_cannot_come_back_fails_its_requests_with_unavailable(tmp_path: Path) -> None:
    model = shutil.copytree(default_model_dir(), tmp_path / "model")
    with serve(model, 2, "--worker-recovery-timeout-seconds", "30") as cluster:
        (model / "model.safetensors").unlink()  # the restarted ranks cannot load
        stream = cluster.client.generate_stream("Once upon a time", max_tokens=200, ignore_eos=True, temperature=0)
        next(stream)
        os.kill(_rank_pid(cluster.process.pid, 1), signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "could not be restarted (gave up after " in info.value.details()
        assert "; --worker-recovery-timeout-seconds 30)" in info.value.details()
        gave_up_after = float(info.value.details().split("gave up after ")[1].split(" s;")[0])
        assert gave_up_after < 30  # the load error ended it, not the timeout
        assert "no model.safetensors" in info.value.details()  # the reason the restart failed
        assert cluster.process.wait(60) == 1


def _kill_rank_then_replacements(cluster, num_replacements: int, max_tokens: int):
    """Streams one greedy request; kills rank 1 once it has its first tokens, then the next
    ``num_replacements`` rank 1 processes the restarts start. Returns (the stream's tokens or
    error, the pids killed, monotonic time of the last kill)."""
    stream = cluster.client.generate_stream("Once upon a time", max_tokens=max_tokens, ignore_eos=True,
                                            temperature=0)
    tokens = list(next(stream).token_ids)
    pid = _rank_pid(cluster.process.pid, 1)
    os.kill(pid, signal.SIGKILL)
    killed = [pid, *_kill_replacements(cluster.process.pid, 1, pid, num_replacements)]
    last_kill = time.monotonic()
    try:
        for chunk in stream:
            tokens.extend(chunk.token_ids)
    except grpc.RpcError as exc:
        return exc, killed, last_kill
    return tokens, killed, last_kill


def test_a_replacement_killed_during_the_restart_is_retried_and_the_stream_resumes(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    with serve(None, 2, "--worker-recovery-timeout-seconds", "60", log_path=log_path) as cluster:
        solo = cluster.client.generate("Once upon a time", max_tokens=MAX_TOKENS, ignore_eos=True,
                                       temperature=0).token_ids
        result, killed, last_kill = _kill_rank_then_replacements(cluster, 1, MAX_TOKENS)
        assert len(killed) == 2, "the replacement rank was not seen starting"
        assert not isinstance(result, grpc.RpcError), result.details()
        resumed_s = time.monotonic() - last_kill
        assert result == solo  # resumed by recompute, token for token
        cluster.client.wait_ready(timeout_s=30)
        assert cluster.metric("tpserve:worker_restarts_total") == 1
        print(f"a second failure during the restart: the stream completed {resumed_s:.1f} s after it")
    log = log_path.read_text(errors="replace")
    assert "worker group restart attempt failed; trying again" in log
    assert f"rank 1 on host {socket.gethostname()} was killed by SIGKILL" in log
    assert "restart attempt 1 of 3" in log


def test_a_restart_that_keeps_failing_exits_within_seconds_naming_rank_host_and_cause() -> None:
    with serve(None, 2, "--worker-recovery-timeout-seconds", "60") as cluster:
        # Each of the three restart attempts loses its replacement rank 1 while the group loads.
        error, killed, last_kill = _kill_rank_then_replacements(cluster, 3, 200)
        assert len(killed) == 4, "a replacement rank was not seen starting"
        assert isinstance(error, grpc.RpcError), "the stream completed"
        assert cluster.process.wait(30) == 1
        exit_s = time.monotonic() - last_kill
        print(f"three failed restarts: UNAVAILABLE and exit {exit_s:.1f} s after the last kill: {error.details()}")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        details = error.details()
        assert f"rank 1 on host {socket.gethostname()} was killed by SIGKILL (exit code -9)" in details
        assert "while the group restarted" in details and "restart attempt 3 of 3" in details
        assert exit_s < 15.0


def _stop_replacement(server_pid: int, rank: int, killed_pid: int, timeout_s: float = 60.0) -> int:
    """SIGSTOPs the process of ``rank`` that a restart starts after ``killed_pid``, as soon as it appears: the
    group then stays in its restart until the test sends SIGCONT. Returns its pid.

    Raises:
        AssertionError: no replacement appeared within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = _rank_pid(server_pid, rank)
        except (LookupError, OSError, ValueError):  # between two launches, or a process just gone
            pid = None
        if pid is not None and pid != killed_pid:
            os.kill(pid, signal.SIGSTOP)
            return pid
        time.sleep(0.02)
    raise AssertionError(f"no replacement of rank {rank} appeared within {timeout_s} s")


def test_liveness_stays_serving_while_the_group_restarts_and_readiness_does_not() -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    health_port = free_port()
    with serve(None, 2, *RECOVERY, "--health-port", str(health_port)) as cluster, \
            grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def probe() -> tuple[int, int]:
            """What the kubelet's readiness and liveness probes see (1 s: their default timeoutSeconds)."""
            return tuple(health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
                         for service in ("", LIVENESS_SERVICE))

        assert probe() == (serving, serving)
        stream = cluster.client.generate_stream("Once upon a time", max_tokens=MAX_TOKENS, ignore_eos=True,
                                                temperature=0)
        tokens = list(next(stream).token_ids)
        killed = _rank_pid(cluster.process.pid, 1)
        os.kill(killed, signal.SIGKILL)
        replacement = _stop_replacement(cluster.process.pid, 1, killed)
        try:
            seen = []
            for _ in range(5):  # the group is held in its restart meanwhile
                seen.append(probe())
                time.sleep(0.5)
        finally:
            os.kill(replacement, signal.SIGCONT)
        assert seen == [(not_serving, serving)] * 5
        tokens += [token for chunk in stream for token in chunk.token_ids]
        assert len(tokens) == MAX_TOKENS  # the held request resumed once the group was back
        cluster.client.wait_ready(timeout_s=30)
        assert probe() == (serving, serving)
        assert cluster.metric("tpserve:worker_restarts_total") == 1
