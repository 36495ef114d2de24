"""A shared secret between the processes of one group: every internal gRPC call carries it.

On one host the coordinator reaches its ranks over unix sockets in a private
directory and the rendezvous is a file, so nothing internal is reachable from
the network. Across hosts the node registry and the ranks' WorkerService listen
on the pod network; with ``--cluster-secret-file`` (the same file on every host,
e.g. one Kubernetes Secret) each of those servers refuses any call that does not
carry the secret in its ``x-tpserve-cluster-secret`` metadata, with
UNAUTHENTICATED, and every internal client sends it. Ranks receive the secret in
their environment (``TPSERVE_CLUSTER_SECRET``), never on their command line,
which other users of the host can read. Comparison is constant-time.

No torch: the coordinator, the headless launcher and the ranks all use it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from tpserve.grpc_metadata import metadata_interceptors

METADATA_KEY = "x-tpserve-cluster-secret"
ENV_VAR = "TPSERVE_CLUSTER_SECRET"
_DENIED = "missing or wrong cluster secret (--cluster-secret-file must be the same on every host)"


def read_secret(path: str | Path) -> str:
    """The secret in ``path`` (surrounding whitespace stripped).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not UTF-8 text, or holds fewer than 16 characters.
    """
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:  # raw random bytes: the secret travels in gRPC metadata and HMAC keys as text
        raise ValueError(f"the cluster secret in {path} is not UTF-8 text; write one as text, e.g. "
                         "`openssl rand -hex 32 > FILE`") from None
    if len(secret) < 16:
        raise ValueError(f"the cluster secret in {path} is {len(secret)} characters; use at least 16")
    return secret


def _matches(metadata: Any, expected: bytes) -> bool:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return hmac.compare_digest(value.encode() if isinstance(value, str) else value, expected)
    return False


def client_interceptors(secret: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.insecure_channel(..., interceptors=...)``: none without a secret."""
    return [] if secret is None else metadata_interceptors([(METADATA_KEY, secret)])


def _deny_handler(handler: grpc.RpcMethodHandler, deny: Callable) -> grpc.RpcMethodHandler:
    kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming
                                                                          else "unary")
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(deny, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class SecretServerInterceptor(grpc.ServerInterceptor):
    """For a synchronous server (a rank's WorkerService): refuses calls without the secret."""

    def __init__(self, secret: str) -> None:
        self._expected = secret.encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or _matches(handler_call_details.invocation_metadata, self._expected):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

        return _deny_handler(handler, deny)


class AioSecretServerInterceptor(grpc.aio.ServerInterceptor):
    """For an asyncio server (the leader's node registry): refuses calls without the secret."""

    def __init__(self, secret: str) -> None:
        self._expected = secret.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _matches(handler_call_details.invocation_metadata, self._expected):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

        return _deny_handler(handler, deny)
