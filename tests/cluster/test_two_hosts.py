"""One tensor-parallel group over two hosts: tp 4 as 2 + 2 ranks on stories260k.

The hosts are network namespaces joined by a veth pair (tests/cluster/hosts.py):
the leader (node-rank 0: coordinator + ranks 0, 1) in one, a headless node
(node-rank 1: ranks 2, 3) in the other. The references are the shared goldens,
made with Hugging Face ``transformers``. The group starts twice: headless node
first (it must retry the leader), then leader first (the leader must wait for it,
naming the missing ranks). The first run checks every golden alone and sixteen at
once and ends with an orderly SIGTERM; the second checks them sixteen at once (to
keep CI short) and ends by killing a rank on the headless host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import grpc
import pytest

from tests.cluster.hosts import (
    HEADLESS_IP,
    LEADER_IP,
    LEADER_PUBLIC_IP,
    Hosts,
    descendants,
    netns_unavailable,
    serve_argv,
    stop_process_group,
    two_hosts,
    wait_for_text,
)
from tests.cluster.two_hosts import (
    MASTER_PORT,
    PUBLIC_PORT,
    SERVICE_LINK_ENV,
    START_TIMEOUT_S,
    STEP_TIMEOUT_S,
    Group,
    check_a_killed_rank_fails_the_requests_and_stops_the_group,
    check_goldens_alone,
    check_goldens_sixteen_at_once,
)
from tests.e2e.cluster import pid_alive
from tests.paths import STORIES_DIR, load_goldens, requires_stories
from tpserve.client import Client
from tpserve.stream_move import MovePolicy

pytestmark = [pytest.mark.e2e, requires_stories]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with two_hosts() as created:
        yield created


def group_flags(node_rank: int) -> list[str]:
    flags = ["--model", str(STORIES_DIR), "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", str(node_rank),
             "--master-addr", LEADER_IP, "--master-port", str(MASTER_PORT),
             "--step-timeout-seconds", str(STEP_TIMEOUT_S), "--distributed-timeout-seconds", str(STEP_TIMEOUT_S),
             "--worker-start-timeout-seconds", str(START_TIMEOUT_S)]
    if node_rank == 0:
        return flags + ["--host", LEADER_PUBLIC_IP, "--port", str(PUBLIC_PORT)]
    return flags + ["--headless"]


@pytest.fixture(scope="class")
def group(request, hosts: Hosts, tmp_path_factory) -> Iterator[Group]:
    """Starts the group in the order the test class names (with its leader's ``LEADER_FLAGS``), yields it
    ready, stops it."""
    headless_first = request.cls.HEADLESS_FIRST
    leader_flags = getattr(request.cls, "LEADER_FLAGS", ())
    logs = tmp_path_factory.mktemp("two-hosts")
    env = {**os.environ, **SERVICE_LINK_ENV, "OMP_NUM_THREADS": "1"}
    leader_log, headless_log = logs / "leader.log", logs / "headless.log"
    # Every internal call (node registry, coordinator -> remote ranks) carries the group's secret.
    secret = logs / "cluster-secret"
    secret.write_text("two-hosts-test-secret-0123456789")
    secret_flags = ("--cluster-secret-file", str(secret))

    def start_leader() -> subprocess.Popen:
        return hosts.run(hosts.leader, "host-a", serve_argv(*group_flags(0), *secret_flags, *leader_flags),
                         leader_log, env)

    def start_headless() -> subprocess.Popen:
        proc = hosts.run(hosts.headless, "host-b", serve_argv(*group_flags(1), *secret_flags), headless_log, env)
        procs.append(proc)
        return proc

    procs: list[subprocess.Popen] = []
    # The leader's own statuses, as they come: a broken stream is not moved and sent again.
    client = Client(f"{LEADER_PUBLIC_IP}:{PUBLIC_PORT}", move_policy=MovePolicy(max_moves=0))
    try:
        if headless_first:
            start_headless()
            wait_for_text(headless_log, "waiting for peer", 30)  # it is retrying the leader
            procs.append(start_leader())
        else:
            procs.append(start_leader())
            wait_for_text(leader_log, "waiting for nodes", 30)
            start_headless()
        leader, headless = (procs[1], procs[0]) if headless_first else (procs[0], procs[1])
        client.wait_ready(timeout_s=START_TIMEOUT_S)
        pids = descendants(leader.pid) + descendants(headless.pid)
        yield Group(leader, headless, leader_log, headless_log, client, pids, start_headless)
    finally:
        client.close()
        for proc in procs:
            stop_process_group(proc)


def test_a_leader_address_that_never_resolves_fails_the_headless_node_naming_it(hosts: Hosts, tmp_path: Path) -> None:
    log = tmp_path / "headless.log"
    flags = ["--model", str(STORIES_DIR), "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
             "--headless", "--master-addr", "tpserve-leader.invalid", "--worker-start-timeout-seconds", "3"]
    started = time.monotonic()
    proc = hosts.run(hosts.headless, "host-b", serve_argv(*flags), log, dict(os.environ))
    try:
        returncode = proc.wait(30)
    finally:
        stop_process_group(proc)
    output = log.read_text()
    assert returncode == 1, output
    assert time.monotonic() - started < 3 + 15  # the timeout, plus the interpreter's start-up
    assert "the leader at tpserve-leader.invalid:29500 did not answer within 3 s" in output
    assert "worker.main" not in output  # no rank was started


def test_a_mismatched_node_is_refused_and_a_node_that_never_comes_keeps_the_leader_not_serving(
        hosts: Hosts, tmp_path: Path) -> None:
    from grpc_health.v1 import health_pb2

    leader_log, headless_log = tmp_path / "leader.log", tmp_path / "headless.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = [*group_flags(0)]
    flags[flags.index("--worker-start-timeout-seconds") + 1] = "10"
    leader = hosts.run(hosts.leader, "host-a", serve_argv(*flags), leader_log, env)
    # A node with another dtype: refused by the leader, naming the field.
    mismatched = hosts.run(hosts.headless, "host-b", serve_argv(*group_flags(1), "--dtype", "bfloat16"),
                           headless_log, env)
    statuses = []
    try:
        assert mismatched.wait(30) == 1
        with Client(f"{LEADER_PUBLIC_IP}:{PUBLIC_PORT}") as client:
            while leader.poll() is None:
                with suppress(grpc.RpcError):
                    statuses.append(client.health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
                time.sleep(0.2)
        returncode = leader.wait(30)
    finally:
        stop_process_group(mismatched)
        stop_process_group(leader)
    assert "FAILED_PRECONDITION: node 1 has --dtype=bfloat16, the leader --dtype=auto" in headless_log.read_text()
    output = leader_log.read_text()
    assert returncode == 1, output
    assert statuses and set(statuses) == {health_pb2.HealthCheckResponse.NOT_SERVING}
    assert "missing_ranks=[2, 3]" in output
    assert "nodes [1] (ranks [2, 3]) did not join within 10 s" in output
    assert "ranks started" not in output  # no rank of the leader ran without its group


class TestHeadlessFirst:
    HEADLESS_FIRST = True

    def test_goldens_token_for_token_alone(self, group: Group) -> None:
        assert "waiting for peer" in group.headless_log.read_text()  # it really came first
        check_goldens_alone(group)

    def test_goldens_token_for_token_sixteen_at_once(self, group: Group) -> None:
        check_goldens_sixteen_at_once(group)

    def test_ranks_serve_over_the_group_link_and_the_service_env_is_ignored(self, group: Group) -> None:
        leader_log = group.leader_log.read_text()
        assert f"init_method=tcp://{LEADER_IP}:{MASTER_PORT + 1}" in leader_log
        assert f"{HEADLESS_IP}:{MASTER_PORT + 2}" in leader_log and f"{HEADLESS_IP}:{MASTER_PORT + 3}" in leader_log
        group.worker_pids()
        assert group.client.model_info().tensor_parallel_size == 4

    def test_sigterm_on_the_leader_stops_both_hosts_cleanly(self, group: Group) -> None:
        group.worker_pids()
        group.leader.send_signal(signal.SIGTERM)
        assert group.leader.wait(30) == 0
        assert group.headless.wait(30) == 0
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in group.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in group.pids if pid_alive(p)]


class TestHeadlessLast:
    HEADLESS_FIRST = False
    LEADER_FLAGS = ("--worker-recovery-timeout-seconds", "0")  # the fail-fast path: the group exits

    def test_goldens_token_for_token_sixteen_at_once(self, group: Group) -> None:
        # Every golden once more, in one batch: this start order gives the same tokens.
        assert "missing_ranks=[2, 3]" in group.leader_log.read_text()  # the leader named whom it waited for
        check_goldens_sixteen_at_once(group)

    def test_killing_a_rank_on_the_headless_host_fails_requests_and_stops_the_group(self, group: Group) -> None:
        group.worker_pids()
        check_a_killed_rank_fails_the_requests_and_stops_the_group(group, 3)


RECOVERY_S = 20
METRICS_PORT = 9400


def _metric(name: str) -> float:
    body = urllib.request.urlopen(f"http://{LEADER_PUBLIC_IP}:{METRICS_PORT}/metrics", timeout=5).read().decode()
    return float(next(line.split()[1] for line in body.splitlines() if line.startswith(name + " ")))


def _streams_during(group: Group, requests: list[tuple[str, dict]], fault: Callable[[], None],
                    pauses: list[float] | None = None) -> list:
    """Runs the requests as streams, calls ``fault`` once each has delivered tokens; each stream's
    token ids, or its error. ``pauses``: gets each stream's longest gap between two messages, in s."""
    started = threading.Barrier(len(requests) + 1)

    def one(prompt_and_sampling) -> list[int] | grpc.RpcError:
        prompt, sampling = prompt_and_sampling
        tokens: list[int] = []
        last, longest = time.monotonic(), 0.0
        try:
            for chunk in group.client.generate_stream(prompt, ignore_eos=True, timeout_s=120, **sampling):
                now = time.monotonic()
                longest, last = max(longest, now - last) if tokens else 0.0, now
                tokens.extend(chunk.token_ids)
                if len(tokens) == 2:
                    started.wait(60)
            if pauses is not None:
                pauses.append(longest)
            return tokens
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(len(requests)) as pool:
        results = pool.map(one, requests)
        started.wait(60)
        fault()
        return list(results)


class TestHostLoss:
    """docs/design/cluster.md, "A lost node is a paused group": a lost headless host pauses the group; it resumes
    when the host is back."""

    HEADLESS_FIRST = False
    LEADER_FLAGS = ("--worker-recovery-timeout-seconds", str(RECOVERY_S), "--metrics-port", str(METRICS_PORT))

    def test_a_killed_host_that_comes_back_resumes_every_stream_token_for_token(self, group: Group) -> None:
        goldens = load_goldens()
        requests = [(goldens[i % len(goldens)]["prompt"], dict(max_tokens=96, temperature=0)) for i in range(8)] + \
            [(goldens[i % len(goldens)]["prompt"], dict(max_tokens=96, temperature=0.9, seed=i,
                                                       repetition_penalty=1.2)) for i in range(8)]
        with ThreadPoolExecutor(16) as pool:  # the run without the fault, the same batch
            expected = list(pool.map(lambda r: group.client.generate(r[0], ignore_eos=True, **r[1]).token_ids,
                                     requests))

        def kill_the_host_and_start_it_again() -> None:
            os.killpg(group.headless.pid, signal.SIGKILL)  # its coordinator-less process and both ranks
            time.sleep(3)
            group.headless = group.start_headless()

        pauses: list[float] = []
        results = _streams_during(group, requests, kill_the_host_and_start_it_again, pauses)
        for request, result, want in zip(requests, results, expected, strict=True):
            assert result == want, (request, result)
        # The pause a client sees: the 3 s the host is away, the group's restart, the recompute.
        print(f"host lost and back after 3 s: longest pause a stream saw {max(pauses):.2f} s")
        assert _metric("tpserve:requests_resumed_total") == 16
        assert _metric("tpserve:worker_restarts_total") == 1
        assert "the group restarts" not in group.leader_log.read_text()  # no node was left to stop

    def test_a_host_that_does_not_come_back_fails_the_held_requests_naming_it(self, group: Group) -> None:
        requests = [("Once upon a time", dict(max_tokens=300, temperature=0))] * 4
        results = _streams_during(group, requests, lambda: os.killpg(group.headless.pid, signal.SIGKILL))
        for result in results:
            assert isinstance(result, grpc.RpcError), result
            assert result.code() == grpc.StatusCode.UNAVAILABLE, result.details()
            assert f"; --worker-recovery-timeout-seconds {RECOVERY_S})" in result.details()
            assert float(result.details().split("gave up after ")[1].split(" s;")[0]) >= RECOVERY_S - 1  # the join waited to the end
            assert "nodes [1] (ranks [2, 3]) did not join" in result.details()
        assert group.leader.wait(30) == 1
