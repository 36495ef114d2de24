"""A link between two network namespaces with a fixed one-way delay, made in user space.

For kernels without ``sch_netem`` (``tc qdisc add ... netem`` answers "Specified
qdisc kind is unknown"). Instead of a veth pair, each namespace gets a TAP device,
and a forwarder process in the root namespace copies the Ethernet frames one device
emits to the other, each ``delay_ms`` after it read it:

    namespace A  addr_a ── tap_a ══ forwarder (root namespace, delay each way) ══ tap_b ── addr_b  namespace B

The forwarder creates both devices itself (``TUNSETIFF`` on ``/dev/net/tun``, TAP
without packet information), so they vanish when it exits; the caller then moves them
into the namespaces (the open file descriptors keep working across the move). Frames
keep their order in each direction (one FIFO a direction; a constant delay keeps the
deadlines sorted). The interfaces' counters
(``/sys/class/net/<if>/statistics/{rx,tx}_bytes`` inside the namespace) count the
link's bytes as a veth's do. A large MTU (65000 by default) lets TCP move big segments
in few frames, so that the forwarder (one Python process) costs little per byte.

Run as a script, this file is the forwarder (standard library only):

    python tests/cluster/delay_link.py TAP_A TAP_B --delay-ms 2

It prints ``ready`` once both devices exist, then forwards; a line ``delay MS`` on its
standard input changes the delay (in milliseconds, each direction); end of input stops it.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

TUNSETIFF = 0x400454CA  # _IOW('T', 202, int), linux/if_tun.h
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_FRAME = 65536 + 18  # the largest MTU plus the Ethernet header and a VLAN tag
READS_PER_WAKEUP = 64  # frames read from one device before looking at the other and the clock again


def open_tap(name: str) -> int:
    """Creates TAP device ``name`` in this process's namespace; returns its non-blocking file descriptor.

    The device exists while the descriptor is open (not persistent).

    Raises:
        OSError: no ``/dev/net/tun``, not permitted (needs CAP_NET_ADMIN), or the name is taken.
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def forward(fd_a: int, fd_b: int, delay_s: float, control: int) -> None:
    """Copies frames between the two TAP descriptors, each ``delay_s`` seconds after it was read.

    Returns at end of input on ``control`` (a readable descriptor carrying ``delay MS`` lines).
    A frame the destination refuses (its device is down) is dropped, as a wire without a
    peer would.
    """
    peer = {fd_a: fd_b, fd_b: fd_a}
    queues: dict[int, deque[tuple[float, bytes]]] = {fd_a: deque(), fd_b: deque()}  # by source
    pending = b""
    while True:
        now = time.monotonic()
        for source, queue in queues.items():
            while queue and queue[0][0] <= now:
                frame = queue.popleft()[1]
                try:
                    os.write(peer[source], frame)
                except OSError:
                    pass  # the far device is down or its queue full: the frame is lost
        deadlines = [queue[0][0] for queue in queues.values() if queue]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        readable, _, _ = select.select([fd_a, fd_b, control], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd == control:
                data = os.read(control, 4096)
                if not data:
                    return
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    words = line.split()
                    if len(words) == 2 and words[0] == b"delay":
                        delay_s = float(words[1]) / 1000
                continue
            for _ in range(READS_PER_WAKEUP):
                try:
                    frame = os.read(fd, MAX_FRAME)
                except BlockingIOError:
                    break
                queues[fd].append((now + delay_s, frame))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Forward frames between two TAP devices with a delay.")
    parser.add_argument("tap_a")
    parser.add_argument("tap_b")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    args = parser.parse_args(argv)
    fd_a, fd_b = open_tap(args.tap_a), open_tap(args.tap_b)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -5)  # a wire: not starved by the ranks it connects
    except OSError:
        pass
    print("ready", flush=True)
    forward(fd_a, fd_b, args.delay_ms / 1000, sys.stdin.fileno())
    return 0


@dataclass
class DelayLink:
    """A running forwarder and the names of its two devices (``tap_a`` in namespace A, ``tap_b`` in B)."""

    tap_a: str
    tap_b: str
    delay_ms: float
    process: subprocess.Popen

    def set_delay(self, delay_ms: float) -> None:
        """Changes the one-way delay of both directions, in milliseconds (frames in flight keep theirs)."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"delay {delay_ms}\n".encode())
        self.process.stdin.flush()
        self.delay_ms = delay_ms


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def delay_link(namespace_a: str, addr_a: str, namespace_b: str, addr_b: str, delay_ms: float,
               names: tuple[str, str], mtu: int = 65000) -> Iterator[DelayLink]:
    """Joins two existing namespaces by TAP devices ``names`` with ``delay_ms`` each way.

    ``addr_a`` and ``addr_b`` carry their prefix length ("10.201.0.1/24"). The devices go
    away with the forwarder, which stops on exit, whatever happened.

    Raises:
        RuntimeError: the forwarder did not start (no ``/dev/net/tun``, not root), with its error.
        subprocess.CalledProcessError: an ``ip`` command failed.
    """
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *names, "--delay-ms", str(delay_ms)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            proc.wait(10)
            assert proc.stderr is not None
            raise RuntimeError(f"the delay link's forwarder did not start: {proc.stderr.read().decode()[-2000:]}")
        for namespace, name, addr in ((namespace_a, names[0], addr_a), (namespace_b, names[1], addr_b)):
            _ip("link", "set", name, "netns", namespace)
            _ip("-n", namespace, "addr", "add", addr, "dev", name)
            _ip("-n", namespace, "link", "set", name, "mtu", str(mtu), "up")
        yield DelayLink(names[0], names[1], delay_ms, proc)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # end of input: the forwarder returns, and its devices go
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
