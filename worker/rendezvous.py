"""The torch.distributed rendezvous store, listening on one address only (docs/design/security.md, "Nothing of a
group listens beyond its link").

``init_process_group(init_method="tcp://HOST:PORT")`` has rank 0 host a TCPStore that
listens on every IPv4 and IPv6 address of the machine, whatever HOST is: anyone who
can reach the machine can read and write the group's keys. Here rank 0 binds the
listening socket itself, to HOST's address only, and hands it to the store
(``master_listen_fd``); the other ranks connect as before. On one host the launcher
uses a ``file://`` store instead (no listener at all; launch/group_launcher.py).
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta
from urllib.parse import urlsplit

import structlog
import torch.distributed as dist

log = structlog.get_logger(__name__)


def tcp_store(init_method: str, rank: int, world_size: int, timeout_s: float) -> dist.Store | None:
    """The group's store for a ``tcp://HOST:PORT`` rendezvous; None for any other scheme.

    Rank 0 listens on HOST's address alone when HOST is an address of this machine,
    and on every interface (torch's behaviour, with a warning) when it is not (a
    name that resolves to a NAT or load-balancer address).

    Raises:
        OSError: the port is taken (the message names it and ``--master-port``).
        DistStoreError: the store did not come up within ``timeout_s``.
    """
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return None
    host, port = parts.hostname, parts.port
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    listener = _listen(host, port)
    if listener is None:
        log.warning("the rendezvous address is not an address of this host; the store listens on every interface",
                    host=host, port=port)
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False)
    store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                          master_listen_fd=listener.detach())
    return store


def _listen(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host:port`` only, or None when ``host`` is not this machine's."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == 99:  # EADDRNOTAVAIL: not an address of this host
            return None
        if exc.errno == errno.EADDRINUSE:
            # The leader checked the port at start-up (launch/group_launcher.py); something took it since.
            raise OSError(exc.errno, f"the rendezvous store cannot bind {host}:{port} (--master-port + 1): "
                                     f"{exc.strerror}; choose another --master-port") from None
        raise
    sock.listen(128)
    return sock
