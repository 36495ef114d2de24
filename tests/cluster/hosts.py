"""Two "hosts" on one machine: network namespaces joined by a veth pair, for multi-host tests.

    root namespace (pytest, the client)  10.200.1.1 ── veth ── 10.200.1.2  host A (leader)
                                                                 10.200.0.1  host A
                                                                    │ veth
                                                                 10.200.0.2  host B (headless)

Each node also runs in its own UTS namespace with its own host name, as on two
machines (ranks tell hosts apart by name). Traffic stays inside these links.
``two_hosts(subnet=201)`` uses 10.201.x.x instead (runs beside the tests), and
``two_hosts(delay_ms=2)`` joins A and B by a link that delays each frame 2 ms each
way (tests/cluster/delay_link.py: TAP devices and a forwarder, for kernels without
``tc netem``) instead of the veth pair.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster.delay_link import DelayLink, delay_link



def _subnet() -> int:
    """10.200 alone; under pytest-xdist, 10.(210 + n) for worker gw<n>, so that two modules on two hosts
    run at once without sharing an address (10.201 is the benchmark's, 10.202 the delay link test's)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return 200 if worker is None else 210 + int(worker.removeprefix("gw"))


SUBNET = _subnet()
LEADER_IP, HEADLESS_IP = f"10.{SUBNET}.0.1", f"10.{SUBNET}.0.2"
CLIENT_IP, LEADER_PUBLIC_IP = f"10.{SUBNET}.1.1", f"10.{SUBNET}.1.2"


@dataclass
class Hosts:
    """The namespaces of one test module; names carry the pid, so runs never collide."""

    leader: str
    headless: str
    links: list[str] = field(default_factory=list)
    group_link: tuple[str, str] = ("", "")  # the leader's and the headless host's ends of the A-B link
    leader_ip: str = LEADER_IP
    headless_ip: str = HEADLESS_IP
    client_ip: str = CLIENT_IP
    leader_public_ip: str = LEADER_PUBLIC_IP
    delay: DelayLink | None = None  # the user-space delay link, where it joins A and B

    def run(self, namespace: str, hostname: str, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        """Starts ``argv`` in ``namespace`` with its own host name; stdout and stderr go to ``log``.

        The process leads its own process group, so that the test can end it and every
        rank it started.
        """
        inner = f"hostname {hostname} && exec \"$@\""
        cmd = ["ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c", inner, "sh", *argv]
        with open(log, "wb") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_unavailable() -> str | None:
    """Why this machine cannot create network namespaces, or None when it can."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "`ip` (iproute2) or `unshare` is not installed"
    probe = f"tpprobe{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return f"`ip netns add` is not permitted here: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def two_hosts(subnet: int = SUBNET, delay_ms: float | None = None) -> Iterator[Hosts]:
    """Creates the two namespaces and their links; deletes them on exit, whatever happened.

    Args:
        subnet: the second octet of every address (10.<subnet>.x.x); the tests use :data:`SUBNET`.
        delay_ms: None for a veth pair between A and B; a number (0 included) for the
            user-space delay link with that one-way delay each direction, in milliseconds.
    """
    tag = os.getpid() % 100000
    hosts = Hosts(leader=f"tpA{tag}", headless=f"tpB{tag}", leader_ip=f"10.{subnet}.0.1",
                  headless_ip=f"10.{subnet}.0.2", client_ip=f"10.{subnet}.1.1", leader_public_ip=f"10.{subnet}.1.2")
    try:
        with ExitStack() as stack:
            for ns in (hosts.leader, hosts.headless):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            client_root, client_a = f"tcr{tag}", f"tca{tag}"
            if delay_ms is None:
                hosts.group_link = (f"tga{tag}", f"tgb{tag}")
                _ip("link", "add", hosts.group_link[0], "netns", hosts.leader, "type", "veth", "peer", "name",
                    hosts.group_link[1], "netns", hosts.headless)
                for ns, dev, addr in ((hosts.leader, hosts.group_link[0], hosts.leader_ip),
                                      (hosts.headless, hosts.group_link[1], hosts.headless_ip)):
                    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                    _ip("-n", ns, "link", "set", dev, "up")
            else:
                hosts.group_link = (f"tda{tag}", f"tdb{tag}")
                hosts.delay = stack.enter_context(delay_link(
                    hosts.leader, f"{hosts.leader_ip}/24", hosts.headless, f"{hosts.headless_ip}/24", delay_ms,
                    hosts.group_link))
            _ip("link", "add", client_root, "type", "veth", "peer", "name", client_a, "netns", hosts.leader)
            hosts.links.append(client_root)
            _ip("-n", hosts.leader, "addr", "add", f"{hosts.leader_public_ip}/24", "dev", client_a)
            _ip("-n", hosts.leader, "link", "set", client_a, "up")
            _ip("addr", "add", f"{hosts.client_ip}/24", "dev", client_root)
            _ip("link", "set", client_root, "up")
            yield hosts
    finally:
        for ns in (hosts.leader, hosts.headless):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in hosts.links:  # gone with its peer's namespace; make sure
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from the parent pids of the whole process table (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the command name
        children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        kids = children.get(queue.pop(), [])
        found.extend(kids)
        queue.extend(kids)
    return found


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except FileNotFoundError:
        return []


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL the process group of ``proc`` if it is still there."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def serve_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", "serve", *flags]


def wait_for_text(log: Path, text: str, timeout_s: float) -> None:
    """Waits until ``text`` appears in ``log``.

    Raises:
        TimeoutError: it did not, with the log's tail.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{text!r} not in {log} after {timeout_s} s:\n{log.read_text(errors='replace')[-3000:]}")
