"""The public port's connection limits (launch/connection_limits.py): the open-file limit raised,
the cap resolved from it, the port's connections counted from the kernel's tables, and one log
line per flood instead of one a second."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys

import structlog

from coordinator.metrics import Metrics
from launch.connection_limits import ConnectionWatch, count_tcp_connections, resolve_max_connections
from tests.e2e.cluster import with_nofile


def test_the_soft_open_file_limit_is_raised_to_the_hard_limit() -> None:
    code = ("import resource; from launch.connection_limits import raise_nofile_limit; "
            "print(raise_nofile_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    out = subprocess.run(with_nofile([sys.executable, "-c", code], (256, hard)), capture_output=True, text=True,
                         check=True, timeout=60)
    fields, limits = out.stdout.rsplit(" (", 1)
    assert eval(fields) == {"nofile_soft": hard, "nofile_hard": hard, "nofile_soft_before": 256}
    assert limits.strip() == f"{hard}, {hard})"


def test_the_cap_leaves_descriptors_for_the_server() -> None:
    assert resolve_max_connections(None, 1024) == 768
    assert resolve_max_connections(None, 400) == 200  # at least half the limit
    assert resolve_max_connections(None, 1_048_576) == 1_048_320
    assert resolve_max_connections(50, 1024) == 50  # the flag wins


def test_established_connections_to_a_port_are_counted() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
    accepted = [listener.accept()[0] for _ in range(3)]  # two left in the backlog: counted too
    try:
        assert count_tcp_connections(port) == 5
        for sock in clients[:2]:
            sock.close()
        for sock in accepted[:2]:
            sock.close()
        assert count_tcp_connections(port) == 3
    finally:
        for sock in clients + accepted:
            sock.close()
        listener.close()


def test_a_flood_logs_one_line_when_the_cap_is_reached_and_one_when_it_ends() -> None:
    metrics = Metrics()
    watch = ConnectionWatch(50051, 100, metrics)
    with structlog.testing.capture_logs() as logs:
        for second, count in enumerate([10, 100, 150, 120, 100, 100, 40, 5]):  # one count a second
            watch.observe(count, float(second))
    events = [entry["event"] for entry in logs]
    assert events == ["public port at its connection cap: new connections are closed until some end "
                      "(health still answers on --health-port)", "public port below its connection cap again"]
    assert logs[1]["peak"] == 150 and logs[1]["seconds_at_cap"] == 5.0
    assert metrics.registry.get_sample_value("tpserve:num_connections") == 5
    assert metrics.registry.get_sample_value("tpserve:max_connections") == 100
