"""Every replica behind a client's target, for the calls that must reach all of them (``abort``).

A client's channel balances requests with gRPC's ``round_robin``, which picks one address per call and
tells the caller nothing about which: an ``Abort`` sent on that channel lands on whichever replica is next,
not on the one running the request. So ``abort`` resolves the target itself (:func:`replica_addresses`),
the way gRPC's own resolvers do (an ``ipv4:``/``ipv6:`` list is split, a host name is looked up with the
system resolver), and sends the call to every address over a channel of its own (:class:`ReplicaStubs`).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tpserve.credentials import Credentials
from tpserve.service_config import channel_options
from tpserve.v1 import generate_pb2_grpc

#: The port gRPC dials for a ``dns:`` target that names none.
_GRPC_DEFAULT_PORT = 443
#: Schemes whose target is one endpoint: the client's own channel reaches it.
_SINGLE_ENDPOINT_SCHEMES = ("unix:", "unix-abstract:", "vsock:")


@dataclass(frozen=True, slots=True)
class ReplicaAddresses:
    """The addresses one target resolves to.

    Attributes:
        targets: one gRPC target per address (``ipv4:10.0.0.7:50051``, ``ipv6:[fd00::7]:50051``), in the
            resolver's order, without duplicates.
        authority: the host name the target named (the TLS name to check on every address's certificate),
            or None where the target named addresses.
    """

    targets: tuple[str, ...]
    authority: str | None = None


def _split_host_port(host_port: str, default_port: int) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or a host alone -> (host, port).

    Raises:
        ValueError: the port is not a number.
    """
    if host_port.startswith("["):
        host, _, rest = host_port[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    if host_port.count(":") == 1:
        host, port = host_port.split(":")
        return host, int(port)
    return host_port, default_port


def replica_addresses(target: str, resolve: Callable[..., list] = socket.getaddrinfo) -> ReplicaAddresses | None:
    """The addresses behind ``target`` (as ``tpserve.client.with_default_port`` left it), or None where the
    target is one endpoint (``unix:``, ``vsock:``) or cannot be resolved now (the client's own channel,
    which resolves again on its own, is then the only way to the replicas).

    ``ipv4:a:p,b:p`` and ``ipv6:`` lists are split; ``dns:///name:port``, ``dns://server/name:port`` (the
    system resolver is asked, not ``server``) and a bare ``name:port`` are looked up with ``resolve``
    (:func:`socket.getaddrinfo`, blocking: an asyncio caller runs it in a thread), every A and AAAA record.
    A headless Service's name resolves to every ready replica's pod IP (docs/cluster.md).
    """
    if target.startswith(_SINGLE_ENDPOINT_SCHEMES):
        return None
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            items = [item for item in target[len(scheme):].split(",") if item]
            return ReplicaAddresses(tuple(dict.fromkeys(f"{scheme}{item}" for item in items)))
    host_port, default_port = target, _GRPC_DEFAULT_PORT
    if target.startswith("dns:"):
        rest = target[len("dns:"):]
        host_port = rest[2:].partition("/")[2] if rest.startswith("//") else rest  # dns://authority/name:port
    try:
        host, port = _split_host_port(host_port, default_port)
        infos = resolve(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError, UnicodeError):
        return None
    targets = []
    for family, _, _, _, sockaddr in infos:
        if family == socket.AF_INET:
            targets.append(f"ipv4:{sockaddr[0]}:{sockaddr[1]}")
        elif family == socket.AF_INET6:
            targets.append(f"ipv6:[{sockaddr[0]}]:{sockaddr[1]}")
    if not targets:
        return None
    try:
        ipaddress.ip_address(host)
        authority = None  # an address literal: nothing to tell TLS beyond the address
    except ValueError:
        authority = host
    return ReplicaAddresses(tuple(dict.fromkeys(targets)), authority)


class ReplicaStubs:
    """One ``GenerationStub`` per replica address, on channels of their own, kept until :meth:`close`
    (an abort is rare, but a client that aborts often should not pay a TLS handshake each time).

    Args:
        credentials: the client's TLS files (the API key travels in each call's metadata).
        asynchronous: grpc.aio channels (for :class:`tpserve.client.AsyncClient`; create them on its loop).
    """

    def __init__(self, credentials: Credentials, asynchronous: bool) -> None:
        self.credentials = credentials
        self.asynchronous = asynchronous
        self._channels: dict[tuple[str, str | None], Any] = {}
        self._stubs: dict[tuple[str, str | None], generate_pb2_grpc.GenerationStub] = {}

    def stubs(self, addresses: ReplicaAddresses) -> list[generate_pb2_grpc.GenerationStub]:
        """A stub for each of ``addresses``' targets, one connection each (``pick_first`` on one address);
        none for a single address, which the client's own channel reaches.

        Raises:
            OSError: a TLS file cannot be read.
        """
        if len(addresses.targets) <= 1:
            return []
        stubs = []
        for target in addresses.targets:
            key = (target, addresses.authority)
            if key not in self._stubs:
                self._channels[key] = channel = self._channel(target, addresses.authority)
                self._stubs[key] = generate_pb2_grpc.GenerationStub(channel)
            stubs.append(self._stubs[key])
        return stubs

    def _channel(self, target: str, authority: str | None) -> Any:
        options = channel_options("pick_first")
        if self.credentials.tls and authority is not None:
            # The certificate names the host the caller dialled, not each pod's IP address.
            options += [("grpc.ssl_target_name_override", authority), ("grpc.default_authority", authority)]
        aio = grpc.aio if self.asynchronous else grpc
        if self.credentials.tls:
            return aio.secure_channel(target, self.credentials.channel_credentials(), options=options)
        return aio.insecure_channel(target, options=options)

    def close(self) -> list[Any]:
        """Closes every channel (a blocking client's); returns what an asyncio client must await."""
        closing = [channel.close() for channel in self._channels.values()]
        self._channels.clear()
        self._stubs.clear()
        return closing if self.asynchronous else []
