"""The cluster secret: internal servers refuse calls without it, internal clients send it, ranks get it by env."""

from __future__ import annotations

import asyncio
import json
import os
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.e2e.cluster import child_pids, serve
from tpserve.cluster_secret import (
    AioSecretServerInterceptor,
    SecretServerInterceptor,
    client_interceptors,
    read_secret,
)
from tpserve.v1 import worker_pb2, worker_pb2_grpc

SECRET = "s3cret-shared-by-every-host"


async def _check(target: str, secret: str | None) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(target, interceptors=client_interceptors(secret)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            async for _ in stub.Watch(health_pb2.HealthCheckRequest(), timeout=1):  # a response stream too
                break
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_synchronous_server_refuses_calls_without_the_secret() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[SecretServerInterceptor(SECRET)])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        assert asyncio.run(_check(target, SECRET)) == grpc.StatusCode.OK
        assert asyncio.run(_check(target, None)) == grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(_check(target, "another-secret-of-16+")) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_an_asyncio_server_refuses_calls_without_the_secret() -> None:
    async def run() -> list[grpc.StatusCode]:
        server = grpc.aio.server(interceptors=[AioSecretServerInterceptor(SECRET)])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return [await _check(f"127.0.0.1:{port}", s) for s in (SECRET, None, "x" * 20)]
        finally:
            await server.stop(0)

    assert asyncio.run(run()) == [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED]


def test_short_or_missing_secrets_are_refused(tmp_path: Path) -> None:
    (tmp_path / "short").write_text("tooshort\n")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret(tmp_path / "short")
    (tmp_path / "ok").write_text(f"  {SECRET}\n")
    assert read_secret(tmp_path / "ok") == SECRET
    (tmp_path / "binary").write_bytes(bytes(range(0x80, 0xA0)))  # `head -c 32 /dev/urandom`: a codec error before
    with pytest.raises(ValueError, match=r"is not UTF-8 text; write one as text, e.g. `openssl rand -hex 32"):
        read_secret(tmp_path / "binary")


@pytest.mark.e2e
def test_a_group_with_a_secret_serves_and_its_ranks_refuse_strangers(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    with serve(None, 2, "--cluster-secret-file", str(secret_file)) as cluster:
        assert cluster.client.generate("Once upon a time", max_tokens=8, temperature=0).usage.completion_tokens == 8
        rank_pid = next(p for p in child_pids(cluster.process.pid)
                        if b"worker.main" in Path(f"/proc/{p}/cmdline").read_bytes())
        cmdline = Path(f"/proc/{rank_pid}/cmdline").read_bytes().decode().split("\0")
        assert SECRET not in " ".join(cmdline)  # never on a command line (/proc/*/cmdline is world-readable)
        rank_config = Path(cmdline[cmdline.index("--config") + 1]).read_text()  # launch/local_ranks.py writes it
        assert SECRET not in rank_config  # nor in the rank's config file: only its path is
        address = json.loads(rank_config)["address"]
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert os.environ.get("TPSERVE_CLUSTER_SECRET") is None
