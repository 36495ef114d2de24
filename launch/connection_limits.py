"""The public port's defences against connection floods (docs/design/faults.md, "Silent connections").

A TCP connection that never sends a byte costs the server a file descriptor until gRPC's
handshake timeout (120 s by default) closes it; at the common soft limit of 1,024 open
files, about a thousand of them left no descriptor to accept anyone else: every fresh
request timed out and health answered UNAVAILABLE. Four measures, all at start-up:

- the soft ``RLIMIT_NOFILE`` is raised to the hard limit (:func:`raise_nofile_limit`), as
  vLLM's API server does; both numbers are in the one "listening" log line;
- connections are capped below that limit (gRPC core's
  ``grpc.max_allowed_incoming_connections``; :func:`resolve_max_connections`): past the
  cap gRPC accepts and closes at once, so the descriptors left serve the ranks, the
  tokenizer and the health port;
- a connection that has not sent the HTTP/2 preface and SETTINGS within
  ``--handshake-timeout-seconds`` is closed (``grpc.server_handshake_timeout_ms``;
  both channel args checked against grpcio 1.85 in tests/e2e/test_connection_flood.py);
- :class:`ConnectionWatch` counts the port's connections into ``tpserve:num_connections``
  and logs one line when the cap is reached and one when the flood ends (with its peak),
  never a line per second.
"""

from __future__ import annotations

import asyncio
import resource
from pathlib import Path

import structlog

from coordinator.metrics import Metrics

log = structlog.get_logger(__name__)

#: Descriptors kept out of the connection cap: rank sockets, the tokenizer's and the grammar
#: compilers' files and pipes, /metrics, the health port, gRPC's own event fds.
RESERVED_FDS = 256
#: Seconds between two counts of the public port's connections.
WATCH_INTERVAL_S = 2.0
#: TCP_ESTABLISHED in /proc/net/tcp's "st" column.
_TCP_ESTABLISHED = "01"


def raise_nofile_limit() -> dict[str, int]:
    """Raises the soft limit on open files to the hard limit.

    Returns:
        ``nofile_soft`` (the soft limit now in force) and ``nofile_hard``, and
        ``nofile_soft_before`` where it was raised: fields for the one "listening" log line.
        A hard limit of "unlimited" is not representable as a soft limit on every kernel:
        the soft limit then goes as far as ``/proc/sys/fs/nr_open`` allows. A refused
        raise is logged as a warning and leaves the limit as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return {"nofile_soft": soft, "nofile_hard": hard}
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("open-file limit not raised", soft=soft, hard=hard, error=str(exc))
        return {"nofile_soft": soft, "nofile_hard": hard}
    return {"nofile_soft": target, "nofile_hard": hard, "nofile_soft_before": soft}


def resolve_max_connections(requested: int | None, nofile: int) -> int:
    """The public port's connection cap: ``requested`` (``--max-connections``), else what
    ``nofile`` open files leave after :data:`RESERVED_FDS` (at least half of them).

    A requested cap the limit cannot hold is kept (the operator asked for it) with a warning:
    past the limit, accepts fail and the flood locks clients out again.
    """
    budget = max(nofile - RESERVED_FDS, nofile // 2, 1)
    if requested is None:
        return budget
    if requested > budget:
        log.warning("--max-connections exceeds what the open-file limit leaves; a flood can exhaust it",
                    max_connections=requested, nofile=nofile, reserved=RESERVED_FDS)
    return requested


def connection_options(handshake_timeout_s: float, max_connections: int) -> list[tuple[str, int]]:
    """gRPC core channel args of a listener: close silent connections after ``handshake_timeout_s``
    seconds, and accept at most ``max_connections`` at a time (the next are closed at once)."""
    return [("grpc.server_handshake_timeout_ms", max(int(handshake_timeout_s * 1000), 1)),
            ("grpc.max_allowed_incoming_connections", max_connections)]


def count_tcp_connections(port: int, proc_net: Path = Path("/proc/net")) -> int:
    """Established TCP connections whose local port is ``port`` (IPv4 and IPv6), from the
    kernel's tables: what gRPC has accepted plus what waits in the listen backlog."""
    local_port = f":{port:04X}"
    count = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _TCP_ESTABLISHED and fields[1].endswith(local_port):
                count += 1
    return count


class ConnectionWatch:
    """Counts the public port's connections every :data:`WATCH_INTERVAL_S` seconds into
    ``tpserve:num_connections``; logs once when the count reaches ``max_connections`` and once
    when it falls back below (with the peak and the seconds at the cap).

    Args:
        port: the public port.
        max_connections: its cap (also set into ``tpserve:max_connections``).
        metrics: the coordinator's metrics.
    """

    def __init__(self, port: int, max_connections: int, metrics: Metrics) -> None:
        self.port = port
        self.max_connections = max_connections
        self.metrics = metrics
        self._task: asyncio.Task | None = None
        self._full_since: float | None = None  # loop time the cap was reached; None below it
        self._peak = 0
        metrics.max_connections.set(max_connections)

    def start(self) -> None:
        """Starts counting (on the running loop)."""
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        """Stops counting."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.observe(await asyncio.to_thread(count_tcp_connections, self.port), loop.time())
            await asyncio.sleep(WATCH_INTERVAL_S)

    def observe(self, num_connections: int, now: float) -> None:
        """One count (``now``: seconds, monotonic): sets the gauge, logs a change of state."""
        self.metrics.num_connections.set(num_connections)
        if num_connections >= self.max_connections:
            self._peak = max(self._peak, num_connections)
            if self._full_since is None:
                self._full_since = now
                log.warning("public port at its connection cap: new connections are closed until some end "
                            "(health still answers on --health-port)", num_connections=num_connections,
                            max_connections=self.max_connections)
        elif self._full_since is not None:
            log.info("public port below its connection cap again", num_connections=num_connections,
                     peak=self._peak, seconds_at_cap=round(now - self._full_since, 1))
            self._full_since, self._peak = None, 0
