"""A Generation servicer of a test's own on a loopback port, in this process (no model, no ranks)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from tpserve.v1 import generate_pb2_grpc


@contextmanager
def generation_server(servicer: generate_pb2_grpc.GenerationServicer, *, with_health: bool = False,
                      num_threads: int = 4) -> Iterator[str]:
    """Serves ``servicer`` (and, ``with_health``, a health service whose "" is SERVING) until the block ends;
    yields the ``127.0.0.1:PORT`` target. Release handlers that wait before the block ends: the stop cancels
    every call without a grace."""
    server = grpc.server(ThreadPoolExecutor(num_threads))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    if with_health:
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
