"""Start a real ``tpserve serve`` (coordinator + worker processes) for end-to-end tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tpserve.client import Client, Credentials
from tpserve.stream_move import MovePolicy

START_TIMEOUT_S = 180.0


#: Ports free_port draws from: below Linux's default ephemeral range (32768-60999, ip_local_port_range), from which
#: the kernel takes the source ports of outgoing connections. A port the kernel handed out as "free" (bind to 0)
#: came from that very range, and a test's client connection could take it as its source port before the server
#: bound it ("--metrics-port N: cannot bind it (Address already in use)", seen once in CI). A port is free only
#: when drawn: bind it soon (tests/worker/pp_harness.py draws each layout's as the layout starts).
_PORTS = (10000, 32767)
_port_random = random.SystemRandom()  # os.urandom's: no state a fork server's children would share


def free_port() -> int:
    """A localhost TCP port nothing listens on, outside the ephemeral range (:data:`_PORTS`)."""
    for _ in range(200):
        port = _port_random.randint(*_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: draw again
            return port
    raise RuntimeError(f"no free port in {_PORTS[0]}-{_PORTS[1]} after 200 draws")


def with_nofile(cmd: list[str], nofile: tuple[int, int]) -> list[str]:
    """``cmd`` (a Python command line: ``[sys.executable, ...]``) run under the open-file limit
    ``nofile`` (soft, hard), as a container's ulimit sets it.

    The limit is set by a small interpreter that then execs ``cmd``, not by Popen's
    ``preexec_fn``: that runs Python in the forked child of a process whose gRPC threads may
    hold locks at the fork ("skipping fork() handlers"), and such a child can abort (SIGABRT)
    before it execs.
    """
    assert cmd[0] == sys.executable, cmd
    soft, hard = nofile
    trampoline = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    return [sys.executable, "-c", trampoline, *cmd[1:]]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread exited while we looked
            continue
        pids.extend(int(c) for c in children)
    return pids


def rank_pids(pid: int) -> list[int]:
    """The server's worker ranks among its children (not its grammar compilers, coordinator/grammar_compiler.py)."""
    ranks = []
    for child in child_pids(pid):
        try:
            if b"worker.main" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                ranks.append(child)
        except FileNotFoundError:  # exited while we looked
            continue
    return ranks


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class RunningCluster:
    process: subprocess.Popen
    port: int
    metrics_port: int
    target: str
    client: Client

    def metric(self, name: str) -> float:
        """Reads one unlabelled sample from the /metrics endpoint."""
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


@contextmanager
def serve(model: str | Path | None, tensor_parallel_size: int, *extra: str,
          omp_threads: int | None = 1, new_session: bool = False,
          credentials: Credentials | None = None, log_path: Path | None = None,
          nofile: tuple[int, int] | None = None) -> Iterator[RunningCluster]:
    """Runs ``tpserve serve`` until the block exits, then SIGTERMs it and checks nothing is left.

    ``omp_threads``: OMP_NUM_THREADS of every rank (1 for tests); None leaves the
    server's own rule (the host's cores split among the ranks), as benchmarks want.
    ``credentials``: what the readiness client (and ``RunningCluster.client``) sends,
    for a server started with TLS or API-key flags.
    ``log_path``: write the server's (and its ranks') stdout and stderr there.
    ``new_session``: start it in a session (and process group) of its own, whose id is
    its pid, so that a test can signal the whole group as a terminal or a container
    runtime does.
    ``nofile``: the server's (soft, hard) limit on open files, as a container's ulimit sets it.
    """
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--tensor-parallel-size", str(tensor_parallel_size),
           "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port), *extra]
    if model is not None:
        cmd += ["--model", str(model)]
    # One thread per rank: the tests' tiny models gain nothing from more, and the
    # machine's cores are shared with the test process and the coordinator.
    env = dict(os.environ)
    if omp_threads is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    log_file = None if log_path is None else open(log_path, "wb")  # noqa: SIM115 - closed in finally
    if nofile is not None:
        cmd = with_nofile(cmd, nofile)
    process = subprocess.Popen(cmd, env=env, start_new_session=new_session, stdout=log_file,
                               stderr=None if log_file is None else subprocess.STDOUT)
    # The server's own statuses, as they come: a broken stream is not moved and sent again (tpserve.stream_move).
    client = Client(f"127.0.0.1:{port}", credentials=credentials or Credentials(), move_policy=MovePolicy(max_moves=0))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                # The log's tail says why (a test that asked for one), so that a failure in CI explains itself.
                tail = "" if log_path is None else "; its log ends:\n" + log_path.read_bytes()[-3000:].decode(errors="replace")
                raise RuntimeError(f"tpserve serve exited with {process.returncode} during start-up{tail}")
            try:
                client.wait_ready(timeout_s=1.0)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        yield RunningCluster(process, port, metrics_port, f"127.0.0.1:{port}", client)
    finally:
        client.close()
        workers = child_pids(process.pid) if process.poll() is None else []
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if pid_alive(pid)]
        if log_file is not None:
            log_file.close()
        assert not left, f"worker processes {left} outlived tpserve serve"


#: A shared server's configuration: (model directory or None for the embedded one, tensor_parallel_size, extra flags).
ServerKey = tuple[str | None, int, tuple[str, ...]]


class SharedServers:
    """``tpserve serve`` processes shared by every test that needs the same configuration.

    A start-up costs seconds of CPU (a coordinator and one process per rank, each importing
    torch); tests that only send requests to a server share one per configuration, started
    on first use (the ``shared_server`` fixture, tests/conftest.py). At most ``max_running``
    run at once; starting another stops the least recently used one.

    What a sharing test may do: requests of any kind, cancellations, deadlines, bad input.
    What it must not do: stop, signal, drain or kill the server or a rank, or assert an
    absolute counter that another test's requests move (read the counter before and after
    and compare the difference, as tests/bench/test_e2e.py does). Such tests, and tests
    that need flags of their own, call :func:`serve` and get a server to themselves.
    """

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.num_started = 0
        self.num_requests = 0
        self._running: OrderedDict[ServerKey, tuple[ExitStack, RunningCluster]] = OrderedDict()

    def get(self, model: str | Path | None, tensor_parallel_size: int, *extra: str) -> RunningCluster:
        """The running server of this configuration (started now if none is).

        Raises:
            RuntimeError: the shared server of this configuration has exited (a test stopped it).
        """
        key: ServerKey = (None if model is None else str(model), tensor_parallel_size, extra)
        self.num_requests += 1
        if key in self._running:
            self._running.move_to_end(key)
            running = self._running[key][1]
            if running.process.poll() is not None:
                raise RuntimeError(f"the shared server {key} exited with {running.process.returncode}: "
                                   "a test that stops its server must start its own with serve()")
            return running
        while len(self._running) >= self.max_running:
            self._stop(next(iter(self._running)))
        stack = ExitStack()
        running = stack.enter_context(serve(model, tensor_parallel_size, *extra))
        self.num_started += 1
        self._running[key] = (stack, running)
        return running

    def _stop(self, key: ServerKey) -> None:
        stack, _ = self._running.pop(key)
        stack.close()

    def close(self) -> None:
        """Stop every running server (each checked as :func:`serve` checks it: no rank outlives it)."""
        while self._running:
            self._stop(next(reversed(self._running)))
