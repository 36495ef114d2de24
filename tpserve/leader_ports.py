"""The ports a leader listens on, and two of them on one number refused when the configuration is validated.

A leader (``node_rank`` 0) binds, on its host:

=========================================  =============================================================
port                                       when
=========================================  =============================================================
``--port``                                 always (the public gRPC port)
``--health-port``, ``--metrics-port``      given
``--master-port``, ``--master-port + 1``   ``--nnodes`` > 1: the node registry, the rendezvous store
                                           (launch/topology.py)
``side_channel_port + rank``, every rank   ``--kv-transfer-config`` (tpserve/kv_transfer_config.py)
=========================================  =============================================================

Two of them on one number cannot both be bound: the second bind failed at start-up as if "another
process listens there", when the other listener was the server itself. A number is one port of the
machine whatever addresses they listen on (``--host``, ``--master-addr``, ``side_channel_host``): one
rule, and ``--host 0.0.0.0``, the default, takes the port on every address anyway. Port 0 lets the
system choose and clashes with nothing. A headless node binds only its ranks' ``--master-port + 2 +
local_rank``: consecutive ports, which cannot clash among themselves.

``config`` is a :class:`tpserve.config.ClusterConfig`, not imported: its validation calls this module. No torch
here: the coordinator reads this too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PortUse:
    """One port a leader binds: the value ``base`` of ``flag`` (of ``owner``'s, where the flag is a key of
    another flag's value) plus ``offset``, and ``what`` listens there when the offset is not 0."""

    flag: str
    base: int
    offset: int = 0
    what: str = ""
    owner: str = ""

    @property
    def port(self) -> int:
        """The TCP port number bound."""
        return self.base + self.offset

    def name(self) -> str:
        """``--port``; ``--master-port + 1 (the rendezvous store)``."""
        derived = f" + {self.offset} ({self.what})" if self.offset else ""
        return f"{self.owner}{self.flag}{derived}"

    def named_with_value(self) -> str:
        """``--metrics-port 9400``; ``--master-port 29500 + 1 (the rendezvous store)``."""
        derived = f" + {self.offset} ({self.what})" if self.offset else ""
        return f"{self.owner}{self.flag} {self.base}{derived}"


def leader_ports(config: Any) -> list[PortUse]:
    """Every port ``config``'s leader binds, in the order of the module's table, without port 0 (any free one)."""
    server, parallel = config.server, config.parallel
    uses = [PortUse("--port", server.port)]
    uses += [PortUse(flag, port) for flag, port in (("--health-port", server.health_port),
                                                    ("--metrics-port", server.metrics_port)) if port is not None]
    if parallel.nnodes > 1:
        uses += [PortUse("--master-port", parallel.master_port),
                 PortUse("--master-port", parallel.master_port, 1, "the rendezvous store")]
    kv = config.kv_transfer.kv_transfer_config
    if kv is not None:  # every rank on the leader's host: a KV transfer needs --nnodes 1
        uses += [PortUse("side_channel_port", kv.side_channel_port, rank, f"rank {rank}'s KV side channel",
                         owner="--kv-transfer-config's ") for rank in range(parallel.world_size)]
    return [use for use in uses if use.port != 0]


def check_port_clashes(config: Any) -> None:
    """Refuses two of the leader's ports on one number, naming both, before anything binds.

    Raises:
        ValueError: ``--metrics-port 9400 is also --port; choose another --metrics-port`` (the later of
            the two in the module's table is the one named first).
    """
    if config.parallel.headless:
        return
    first: dict[int, PortUse] = {}
    for use in leader_ports(config):
        earlier = first.setdefault(use.port, use)
        if earlier is not use:
            raise ValueError(f"{use.named_with_value()} is also {earlier.name()}; choose another {use.flag}")
