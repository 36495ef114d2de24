"""Small network helpers of a multi-host group: wait for a peer, find an interface.

Hosts of a group start in any order, and on Kubernetes a pod's DNS name appears
only some seconds after the pod, so every look-up and connect here is retried with
exponential backoff until a deadline, and every failure names the address. No torch.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import time

import structlog

log = structlog.get_logger(__name__)

#: First and largest pause between attempts, seconds.
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 2.0
#: Seconds between "still waiting" log lines.
LOG_EVERY_S = 5.0
#: ioctl that reads an interface's IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915


class PeerTimeout(RuntimeError):
    """The peer did not resolve or accept a connection before the deadline; the message names it."""


async def wait_for_peer(host: str, port: int, timeout_s: float, what: str) -> str:
    """Retries resolving ``host`` and connecting to ``host:port`` until one connect succeeds.

    Args:
        host: host name or address.
        port: TCP port.
        timeout_s: seconds to keep trying.
        what: the peer's role for log lines and the error, e.g. ``"the leader"``.

    Returns:
        The local IP address of the successful connection: the address of this host's
        interface that reaches the peer (the one to bind and advertise).

    Raises:
        PeerTimeout: no connection within ``timeout_s``, with the last error.
    """
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    pause, last_log, error = BACKOFF_FIRST_S, 0.0, "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerTimeout(f"{what} at {host}:{port} did not answer within {timeout_s:g} s (last error: {error})")
        try:
            # Bounded: a resolver that does not answer must not outlive the deadline.
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), remaining)
            local_ip = await asyncio.wait_for(_connect_any(infos), max(deadline - time.monotonic(), 0.01))
            log.info("reached peer", peer=what, address=f"{host}:{port}", local_ip=local_ip)
            return local_ip
        except (OSError, asyncio.TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if time.monotonic() - last_log >= LOG_EVERY_S:
            log.info("waiting for peer", peer=what, address=f"{host}:{port}", error=error)
            last_log = time.monotonic()
        await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, BACKOFF_MAX_S)


async def _connect_any(infos: list) -> str:
    error: OSError = OSError("no address")
    for family, _, _, _, sockaddr in infos:
        try:
            _, writer = await asyncio.open_connection(sockaddr[0], sockaddr[1], family=family)
        except OSError as exc:
            error = exc
            continue
        local_ip = writer.get_extra_info("sockname")[0]
        writer.close()
        return local_ip
    raise error


async def resolve(host: str, timeout_s: float, what: str) -> str:
    """The first IPv4 or IPv6 address of ``host``, retrying with backoff until ``timeout_s``.

    Raises:
        PeerTimeout: ``host`` did not resolve in time.
    """
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    pause, error = BACKOFF_FIRST_S, "no attempt"
    while time.monotonic() < deadline:
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, None, type=socket.SOCK_STREAM),
                                           deadline - time.monotonic())
            return str(infos[0][4][0])  # an IPv4/IPv6 address string (the tuple is typed str | int)
        except (OSError, asyncio.TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, BACKOFF_MAX_S)
    raise PeerTimeout(f"{what} {host!r} did not resolve within {timeout_s:g} s (last error: {error})")


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is ``ip`` (Linux), or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
        if socket.inet_ntoa(answer[20:24]) == ip:
            return name
    return None


def host_port(host: str, port: int) -> str:
    """``host:port`` for a gRPC target or bind address (IPv6 addresses in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_taken(host: str, port: int) -> OSError | None:
    """Whether another socket holds TCP ``host:port`` (``host`` an address of this machine, ``0.0.0.0``: every
    IPv4 one): the bind error, or None when a listener could bind it now. Binds with ``SO_REUSEADDR``, as the
    rendezvous store does (worker/rendezvous.py), so a port whose old connections linger in TIME_WAIT counts as
    free; the socket is closed at once (what the port is used for binds it moments later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None
