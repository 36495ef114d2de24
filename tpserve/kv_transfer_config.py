"""``--kv-transfer-config``: prefill/decode roles and the KV transfer's side channel, in vLLM's JSON shape.

    --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                           "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"side_channel_host": "10.0.0.7",
                                                         "side_channel_port": 5600}}'

The same object as vLLM's ``KVTransferConfig`` (``kv_connector``, ``kv_role``, ``engine_id``,
``kv_connector_extra_config``); the gateway (``smg --pd-disaggregation``) pairs a prefill and a
decode replica on the fields GetServerInfo reports from it. Every rank of a replica listens
on ``side_channel_port + global rank`` of ``side_channel_host`` (docs/design/cluster.md,
"Prefill/decode disaggregation").

``kv_connector_extra_config`` keys (each optional):

- ``side_channel_host`` (default ``127.0.0.1``), ``side_channel_port`` (default 5600): where the
  ranks' KV agents listen and what a prefill replica advertises as ``remote_host``/``remote_port``;
- ``transport``: ``tcp`` (every device; the default) or ``nixl`` (the nixl package, CUDA ranks):
  refused with one line when the package is not installed;
- ``hold_timeout_s`` (default 30): how long a prefill replica keeps a finished request's blocks
  for its decode replica to pull before it frees them (a gateway sends the decode request as soon
  as the prefill answers, and the decode replica pulls before it queues it: a pull comes within
  milliseconds to seconds; 120 let unpulled hand-offs pin the pool for two minutes);
- ``max_hold_fraction`` (default 0.5) and ``max_hold_fraction_per_tenant`` (default 0.25): the share of
  the KV pool a producer's hand-offs may hold, in all and for one API-key tenant; past either a
  ``do_remote_decode`` is refused with RESOURCE_EXHAUSTED and pushback (coordinator/kv_transfer/hold_budget.py);
- ``pull_timeout_s`` (default 10): how long a decode replica waits for a pull before it prefills
  the prompt itself.

The side channel listens beyond loopback only with ``--cluster-secret-file`` (tpserve/config.py refuses
it otherwise): without the secret nothing authenticates a peer's reads or the K/V it serves
(docs/design/security.md, "The KV side channel").

No torch: the coordinator reads this too.
"""

from __future__ import annotations

import errno
import importlib.util
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
Transport = Literal["tcp", "nixl"]
#: The connector whose kv_transfer_params this server speaks (do_remote_decode, remote_block_ids, ...):
#: the gateway runs its NIXL hand-off for a worker that reports it.
CONNECTORS = ("NixlConnector",)
DEFAULT_SIDE_CHANNEL_PORT = 5600
#: Seconds a hand-off's blocks wait for their pull by default (the module docstring says why not longer).
DEFAULT_HOLD_TIMEOUT_S = 30.0


class KVTransferConfig(BaseModel):
    """One replica's part in prefill/decode disaggregation (vLLM's ``KVTransferConfig``).

    Attributes:
        kv_connector: ``NixlConnector`` (the kv_transfer_params it speaks; the transport is
            ``kv_connector_extra_config.transport``).
        kv_role: ``kv_producer`` (prefills and hands its blocks over), ``kv_consumer`` (pulls them
            and decodes) or ``kv_both``.
        engine_id: this replica's id in ``remote_engine_id`` (default: ``tpserve-<side channel port>``).
        kv_connector_extra_config: the side channel, transport and timeouts (module docstring).

    Raises:
        ValueError: an unknown connector, role or extra key, a port out of range, a timeout
            not above 0, a hold share outside (0, 1], or ``transport: nixl`` without the nixl package.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    kv_connector: str
    kv_role: KVRole = "kv_both"
    engine_id: str = ""
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kv_connector")
    @classmethod
    def _check_connector(cls, value: str) -> str:
        if value not in CONNECTORS:
            raise ValueError(f"kv_connector {value!r} is not served; use one of {', '.join(CONNECTORS)}")
        return value

    @model_validator(mode="after")
    def _check_extra(self) -> KVTransferConfig:
        extra = self.kv_connector_extra_config
        unknown = sorted(set(extra) - {"side_channel_host", "side_channel_port", "transport", "hold_timeout_s",
                                       "pull_timeout_s", "max_hold_fraction", "max_hold_fraction_per_tenant"})
        if unknown:
            raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}")
        port = extra.get("side_channel_port", DEFAULT_SIDE_CHANNEL_PORT)
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535 - 64:
            raise ValueError(f"kv_connector_extra_config.side_channel_port must be a port in [1, 65471], got {port!r}")
        for key in ("hold_timeout_s", "pull_timeout_s"):
            value = extra.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 86400:
                raise ValueError(f"kv_connector_extra_config.{key} must be seconds in (0, 86400), got {value!r}")
        for key in ("max_hold_fraction", "max_hold_fraction_per_tenant"):
            value = extra.get(key, 0.5)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"kv_connector_extra_config.{key} must be a share of the KV pool in (0, 1], "
                                 f"got {value!r}")
        host = extra.get("side_channel_host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError(f"kv_connector_extra_config.side_channel_host must be an address, got {host!r}")
        if self.transport not in ("tcp", "nixl"):
            raise ValueError(f"kv_connector_extra_config.transport must be tcp or nixl, got {self.transport!r}")
        if self.transport == "nixl" and importlib.util.find_spec("nixl") is None:
            raise ValueError("kv_connector_extra_config.transport nixl needs the nixl package, which is not "
                             "installed (pip install nixl), or use transport tcp")
        return self

    @property
    def side_channel_host(self) -> str:
        """The address the ranks' KV agents bind and a prefill replica advertises."""
        return str(self.kv_connector_extra_config.get("side_channel_host", "127.0.0.1"))

    @property
    def side_channel_port(self) -> int:
        """Rank ``r``'s agent listens on this port + ``r``."""
        return int(self.kv_connector_extra_config.get("side_channel_port", DEFAULT_SIDE_CHANNEL_PORT))

    @property
    def transport(self) -> str:
        """``tcp`` or ``nixl``."""
        return str(self.kv_connector_extra_config.get("transport", "tcp"))

    @property
    def hold_timeout_s(self) -> float:
        """Seconds a prefill replica holds a handed-over request's blocks at most."""
        return float(self.kv_connector_extra_config.get("hold_timeout_s", DEFAULT_HOLD_TIMEOUT_S))

    @property
    def max_hold_fraction(self) -> float:
        """The share of the KV pool every hand-off's hold together may take, in (0, 1]."""
        return float(self.kv_connector_extra_config.get("max_hold_fraction", 0.5))

    @property
    def max_hold_fraction_per_tenant(self) -> float:
        """The share of the KV pool one API-key tenant's hand-offs may hold, in (0, 1]."""
        return float(self.kv_connector_extra_config.get("max_hold_fraction_per_tenant", 0.25))

    @property
    def pull_timeout_s(self) -> float:
        """Seconds a decode replica waits for a pull before it prefills locally."""
        return float(self.kv_connector_extra_config.get("pull_timeout_s", 10.0))

    @property
    def resolved_engine_id(self) -> str:
        """``engine_id``, or one made from the side channel when it is empty."""
        return self.engine_id or f"tpserve-{self.side_channel_host}-{self.side_channel_port}"

    @property
    def is_producer(self) -> bool:
        """Hands prefilled blocks over (``kv_producer`` or ``kv_both``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Pulls a prefill's blocks (``kv_consumer`` or ``kv_both``)."""
        return self.kv_role in ("kv_consumer", "kv_both")


class KVTransferSection(BaseModel):
    """The configuration's ``kv_transfer`` section: ``--kv-transfer-config`` as JSON text or a mapping (YAML).

    Attributes:
        kv_transfer_config: the replica's role, or None (no disaggregation; the default).

    Raises:
        ValueError: text that is not a JSON object, or a :class:`KVTransferConfig` error.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_transfer_config: KVTransferConfig | None = None

    @field_validator("kv_transfer_config", mode="before")
    @classmethod
    def _parse_json(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
        return value


def side_channel_bind_error(host: str, port: int, rank: int, exc: OSError) -> str:
    """One line for a side channel that cannot be bound: which field, which address, why."""
    where = f"{host}:{port + rank} (rank {rank}'s: side_channel_port {port} + {rank})"
    if exc.errno == errno.EADDRINUSE:
        return (f"--kv-transfer-config: kv_connector_extra_config.side_channel_port: {where} is in use by another "
                "process; choose another side_channel_port")  # this server's own ports: tpserve/leader_ports.py
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"--kv-transfer-config: kv_connector_extra_config.side_channel_host {host} is not an address of "
                f"this machine: cannot listen on {where}")
    return f"--kv-transfer-config: cannot listen on the KV side channel {where}: {exc.strerror or exc}"
