"""tpserve/replica_targets.py: the addresses an abort goes to, resolved as gRPC's resolvers would, without a
network (a fake ``getaddrinfo``); the channels it opens and closes. Against two real servers:
tests/e2e/test_client_abort.py."""

from __future__ import annotations

import asyncio
import socket

from tpserve.credentials import Credentials
from tpserve.replica_targets import ReplicaAddresses, ReplicaStubs, replica_addresses


def _resolver(records: dict[tuple[str, int], list[str]]):
    """A ``getaddrinfo`` answering ``records`` ((host, port) -> addresses), and raising gaierror otherwise."""
    def resolve(host: str, port: int, type: int = 0):  # noqa: A002 (getaddrinfo's keyword)
        if (host, port) not in records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, type, 6, "",
                 (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in records[(host, port)]]
    return resolve


def test_address_lists_are_split_and_names_resolve_to_every_record() -> None:
    assert replica_addresses("ipv4:10.0.0.1:50051,10.0.0.2:50051,10.0.0.1:50051") == \
        ReplicaAddresses(("ipv4:10.0.0.1:50051", "ipv4:10.0.0.2:50051"))
    assert replica_addresses("ipv6:[fd00::1]:5,[fd00::2]:5") == ReplicaAddresses(("ipv6:[fd00::1]:5", "ipv6:[fd00::2]:5"))
    # A headless Service: one A record per ready pod (and an AAAA on a dual-stack cluster).
    resolve = _resolver({("tpserve-replicas.default.svc", 50051): ["10.1.0.7", "10.1.0.8", "fd00::9", "10.1.0.7"],
                         ("tpserve-replicas.default.svc", 443): ["10.1.0.7"]})
    every = ReplicaAddresses(("ipv4:10.1.0.7:50051", "ipv4:10.1.0.8:50051", "ipv6:[fd00::9]:50051"),
                             authority="tpserve-replicas.default.svc")
    for target in ("dns:///tpserve-replicas.default.svc:50051", "dns://10.96.0.10/tpserve-replicas.default.svc:50051",
                   "tpserve-replicas.default.svc:50051"):
        assert replica_addresses(target, resolve) == every, target
    assert replica_addresses("dns:///tpserve-replicas.default.svc", resolve).targets == ("ipv4:10.1.0.7:443",)
    assert replica_addresses("10.0.0.3:50051") == ReplicaAddresses(("ipv4:10.0.0.3:50051",))  # a literal: no TLS name
    assert replica_addresses("[::1]:50051") == ReplicaAddresses(("ipv6:[::1]:50051",))


def test_one_endpoint_or_an_unresolvable_name_leaves_the_clients_own_channel() -> None:
    for target in ("unix:///run/tpserve.sock", "unix-abstract:tpserve", "vsock:3:50051", "nosuch.invalid:50051",
                   "host:port-not-a-number"):
        assert replica_addresses(target, _resolver({})) is None, target


def test_replica_stubs_open_one_channel_per_address_once_and_close_them() -> None:
    two = ReplicaAddresses(("ipv4:127.0.0.1:1", "ipv4:127.0.0.1:2"))
    replicas = ReplicaStubs(Credentials(), asynchronous=False)
    assert replicas.stubs(ReplicaAddresses(("ipv4:127.0.0.1:1",))) == []  # the client's channel reaches it
    first = replicas.stubs(two)
    assert len(first) == 2 and replicas.stubs(two) == first  # kept: no new connection per abort
    assert len(replicas._channels) == 2
    assert replicas.close() == [] and replicas._channels == {}

    async def asynchronous() -> int:
        aio = ReplicaStubs(Credentials(), asynchronous=True)
        aio.stubs(two)
        closing = aio.close()
        await asyncio.gather(*closing)
        return len(closing)

    assert asyncio.run(asynchronous()) == 2
