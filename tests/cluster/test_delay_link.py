"""The user-space delay link (tests/cluster/delay_link.py) delays each direction as set and passes bytes intact.

Two namespaces joined by the link at 2 ms each way: a TCP echo's round trips take at
least 4 ms, and 4 MiB of seeded random bytes come back unchanged; the same link set to
0 ms answers in under 2 ms (so the 4 ms are the link's delay, not a slow machine). The
TAP devices' counters in the namespace count the echoed bytes, as the benchmark reads them.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.cluster.hosts import netns_unavailable, two_hosts
from tests.cluster.link_probe import probe

SUBNET = 202  # not the two-host tests' 10.200 nor the benchmark's 10.201: runs beside both
NBYTES = 4 << 20


def _counter(namespace: str, interface: str, kind: str) -> int:
    return int(subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{interface}/statistics/{kind}"],
                              check=True, capture_output=True, text=True).stdout)


def test_the_delay_link_delays_each_way_and_passes_bytes_intact() -> None:
    reason = netns_unavailable() or (None if os.path.exists("/dev/net/tun") else "no /dev/net/tun (TAP devices)")
    if reason:
        pytest.skip(reason)
    with two_hosts(subnet=SUBNET, delay_ms=2.0) as hosts:
        assert hosts.delay is not None
        tap = hosts.group_link[0]
        before = _counter(hosts.leader, tap, "tx_bytes"), _counter(hosts.leader, tap, "rx_bytes")
        delayed = probe(hosts.headless, hosts.headless_ip, hosts.leader, nbytes=NBYTES)
        sent, received = (_counter(hosts.leader, tap, kind) - b for kind, b in zip(("tx_bytes", "rx_bytes"), before))
        hosts.delay.set_delay(0)
        direct = probe(hosts.headless, hosts.headless_ip, hosts.leader, nbytes=NBYTES)
    assert delayed["intact"] and direct["intact"]
    assert min(delayed["rtt_ms"]) >= 4.0, delayed["rtt_ms"]
    assert min(direct["rtt_ms"]) < 2.0, direct["rtt_ms"]
    # Each way: the payload, plus headers and acknowledgements (a few percent at a 65000-byte MTU).
    assert NBYTES <= sent < 1.2 * NBYTES and NBYTES <= received < 1.2 * NBYTES, (sent, received)
