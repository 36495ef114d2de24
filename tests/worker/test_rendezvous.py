"""The rendezvous store listens on its own address only (docs/design/security.md, "Nothing of a group listens beyond
its link").

torch's ``init_method="tcp://127.0.0.1:P"`` store listens on every interface; a
connection to the port from another address of this machine got in. Here a
2-process gloo group rendezvous through ``tcp://127.0.0.1:P`` and, while the
store is up, a connection to P on a non-loopback address of this machine is
refused.
"""

from __future__ import annotations

import multiprocessing
import socket

import pytest

from tests.worker.rank_processes import spawn_ranks
from tests.worker.tp_harness import _free_port
from worker.parallel_state import destroy_distributed, init_distributed


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine outside 127/8, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
        except OSError:
            return None
        ip = sock.getsockname()[0]
    return None if ip.startswith("127.") else ip


def _rank_main(rank: int, port: int, ip: str, out: multiprocessing.SimpleQueue) -> None:
    ctx = init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "cpu", 30.0, shared_memory=False)
    if rank == 0:
        with socket.socket() as probe:
            probe.settimeout(2)
            try:
                probe.connect((ip, port))
                out.put("accepted")
            except OSError as exc:
                out.put(type(exc).__name__)
    import torch

    ctx.all_reduce(torch.ones(1))  # both ranks stay in the group until the probe is done
    destroy_distributed()


def test_the_store_refuses_connections_to_a_non_loopback_address() -> None:
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to probe from")
    out = multiprocessing.get_context("forkserver").SimpleQueue()
    spawn_ranks(_rank_main, (_free_port(), ip, out), nprocs=2)
    assert out.get() == "ConnectionRefusedError"
