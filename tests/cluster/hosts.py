"""Two "hosts" on one machine: network namespaces joined by a veth pair, for multi-host tests.

    root namespace (pytest, the client)  10.200.1.1 ── veth ── 10.200.1.2  host A (leader)
                                                                 10.200.0.1  host A
                                                                    │ veth
                                                                 10.200.0.2  host B (headless)

Each node also runs in its own UTS namespace with its own host name, as on two
machines (ranks tell hosts apart by name). Traffic stays inside these links.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

LEADER_IP, HEADLESS_IP = "10.200.0.1", "10.200.0.2"
CLIENT_IP, LEADER_PUBLIC_IP = "10.200.1.1", "10.200.1.2"


@dataclass
class Hosts:
    """The namespaces of one test module; names carry the pid, so runs never collide."""

    leader: str
    headless: str
    links: list[str] = field(default_factory=list)

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
def two_hosts() -> Iterator[Hosts]:
    """Creates the two namespaces and their links; deletes them on exit, whatever happened."""
    tag = os.getpid() % 100000
    hosts = Hosts(leader=f"tpA{tag}", headless=f"tpB{tag}")
    try:
        for ns in (hosts.leader, hosts.headless):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        group_a, group_b, client_root, client_a = f"tga{tag}", f"tgb{tag}", f"tcr{tag}", f"tca{tag}"
        _ip("link", "add", group_a, "netns", hosts.leader, "type", "veth", "peer", "name", group_b, "netns", hosts.headless)
        _ip("link", "add", client_root, "type", "veth", "peer", "name", client_a, "netns", hosts.leader)
        hosts.links.append(client_root)
        for ns, dev, addr in ((hosts.leader, group_a, LEADER_IP), (hosts.headless, group_b, HEADLESS_IP),
                              (hosts.leader, client_a, LEADER_PUBLIC_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        _ip("addr", "add", f"{CLIENT_IP}/24", "dev", client_root)
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
