"""Prefill and decode replicas for tests: ``tpserve serve --kv-transfer-config`` with free side-channel ports."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.cluster import RunningCluster, serve


def free_port_range(count: int) -> int:
    """A port ``p`` with ``p .. p + count - 1`` all free now (a replica's ranks listen on consecutive ports)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65000:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def kv_transfer_config(role: str, port: int, engine_id: str, **extra: object) -> str:
    """``--kv-transfer-config`` JSON for a replica of ``role`` whose rank ``r`` listens on ``port + r``."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
                       "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": port,
                                                     **extra}})


@contextmanager
def serve_role(model: Path, tp: int, role: str, engine_id: str, log_path: Path, *extra: str,
               **config: object) -> Iterator[RunningCluster]:
    """One replica of ``role`` (``kv_producer``, ``kv_consumer``, ``kv_both``) in a session of its own."""
    port = free_port_range(tp)
    with serve(model, tp, "--kv-transfer-config", kv_transfer_config(role, port, engine_id, **config), *extra,
               log_path=log_path, new_session=True) as replica:
        yield replica
