"""Silent connections lock no client out (docs/design/faults.md, "Silent connections").

Idle TCP connections that never send a byte were held for gRPC's 120 s handshake timeout;
with the open-file limit reached the server could accept nobody: every fresh request timed
out and health answered UNAVAILABLE. The server here runs under a container-like limit of
400 open files (soft and hard, so it cannot raise it) and gets 600 silent connections: a
fresh Generate and a health check must still succeed within seconds, the silent sockets
must be closed by the server within ``--handshake-timeout-seconds``, and the health port
must answer while the public port is full. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.cluster import free_port, serve
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

pytestmark = pytest.mark.e2e

NOFILE = (400, 400)  # the server's limit on open files: soft and hard, so it cannot raise it
NUM_SILENT = 600  # more than the server has descriptors
HANDSHAKE_TIMEOUT_S = 2.0


def open_silent(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to ``port`` that send nothing (each connect bounded to 2 s)."""
    socks = []
    for _ in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        socks.append(sock)
    return socks


def wait_closed_by_peer(socks: list[socket.socket], since: float, limit_s: float) -> tuple[int, float]:
    """Reads every socket (the server's SETTINGS frame, then EOF) until each has seen EOF or
    ``limit_s`` seconds after ``since`` (monotonic) have passed; returns (sockets closed by the
    server, seconds from ``since`` until the last was seen closed)."""
    pending, last = set(socks), 0.0
    while pending and time.monotonic() - since < limit_s:
        readable, _, _ = select.select(list(pending)[:1000], [], [], 0.2)
        for sock in readable:
            try:
                data = sock.recv(4096)
            except OSError:  # reset: closed too
                data = b""
            if data == b"":
                pending.discard(sock)
                last = time.monotonic() - since
    return len(socks) - len(pending), last


def first_success_s(call, limit_s: float) -> float | None:
    """Seconds until ``call()`` (a fresh RPC) first succeeds, retrying; None if not within ``limit_s``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            call()
            return time.monotonic() - start
        except grpc.RpcError:
            time.sleep(0.2)
    return None


#: A channel of its own subchannel pool opens a new TCP connection (gRPC otherwise shares the
#: connection another channel of this process already holds to the same target).
FRESH_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def fresh_generate(target: str) -> None:
    """A Generate on a new connection: nothing reused from before the flood."""
    with grpc.insecure_channel(target, options=FRESH_CONNECTION) as channel:
        request = pb.GenerateRequest(text="Once upon a time",
                                     sampling_params=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        result = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=3.0)
        assert len(result.token_ids) == 4


def fresh_health_check(target: str) -> int:
    """The health service's status, on a new connection to ``target``."""
    with grpc.insecure_channel(target, options=FRESH_CONNECTION) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3.0).status


def test_silent_connections_lock_no_client_out(tmp_path: Path) -> None:
    health_port = free_port()
    log_path = tmp_path / "server.log"
    with serve(None, 1, "--handshake-timeout-seconds", str(HANDSHAKE_TIMEOUT_S), "--health-port", str(health_port),
               nofile=NOFILE, log_path=log_path) as cluster:
        socks = open_silent(cluster.port, NUM_SILENT)
        flooded = time.monotonic()
        try:
            assert len(socks) >= NOFILE[0], "the flood did not reach the open-file limit"
            # The health port answers while the public port is full.
            started = time.monotonic()
            assert fresh_health_check(f"127.0.0.1:{health_port}") == health_pb2.HealthCheckResponse.SERVING
            health_port_s = time.monotonic() - started
            generate_s = first_success_s(lambda: fresh_generate(cluster.target), 15.0)
            health_s = first_success_s(lambda: fresh_health_check(cluster.target), 15.0)
            closed, last_closed_s = wait_closed_by_peer(socks, flooded, max(time.monotonic() - flooded, 0) + 5.0)
        finally:
            for sock in socks:
                sock.close()
        print(f"under a flood of {len(socks)} silent connections: health port {health_port_s:.2f} s, "
              f"fresh Generate {generate_s} s, health on the public port {health_s} s; "
              f"{closed} closed by the server, the last seen {last_closed_s:.2f} s after the flood")
        assert health_port_s < 3.0
        assert generate_s is not None and generate_s < 10.0, "a fresh Generate did not get through the flood"
        assert health_s is not None and health_s < 10.0, "health on the public port did not answer under the flood"
        assert closed == len(socks), f"{len(socks) - closed} silent connections were still open"
        assert last_closed_s < max(generate_s, health_s) + HANDSHAKE_TIMEOUT_S + 3.0
        assert cluster.metric("tpserve:max_connections") == 200  # the limit less 256, at least half of it
        cluster.client.wait_ready(timeout_s=10)
    log = log_path.read_text(errors="replace")
    assert "nofile_hard=400 nofile_soft=400" in log  # in the "listening" line
    # One line when the cap is reached and one when the flood ends, never one per second.
    assert log.count("connection cap") <= 4, log[-3000:]
    assert log.count("File descriptor limit reached") == 0  # gRPC core: one line a second while accept fails
