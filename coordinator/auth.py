"""Who may call the public API: TLS / mutual TLS credentials and bearer API keys.

* TLS (``--ssl-certfile``, ``--ssl-keyfile``): the server proves its identity and the
  channel is encrypted. Mutual TLS (``--ssl-ca-certs``): a client must also present
  a certificate signed by that CA, or its handshake fails (the client sees
  UNAVAILABLE, the request never reaches a handler).
* API keys (``--api-key``, ``--api-key-file``): every call of the Generation service
  carries ``authorization: Bearer <key>`` metadata (the scheme in any case: RFC 6750
  section 2.1 and RFC 9110 section 11.1 make it case-insensitive), or is refused with
  UNAUTHENTICATED; the refusals' warnings are rate-limited (tpserve/log.py). The health service and server reflection stay open, so that
  Kubernetes probes (which carry no token) keep working; they reveal nothing
  about requests. Keys are compared in constant time (``hmac.compare_digest``)
  and never logged.

Key and certificate files are read at start-up and again on SIGHUP (rotation without a
restart: :class:`ApiKeyInterceptor.set_keys` here, the certificates in
:mod:`coordinator.tls`). No torch.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger(__name__)

#: The methods that need a key: everything of the tpserve Generation service and of the
#: engine protocol a gateway speaks (coordinator/vllm_engine_service.py; smg's --api-key).
_PROTECTED_PREFIX = ("/tpserve.v1.Generation/", "/vllm.grpc.engine.VllmEngine/")
#: ``Bearer <token>``: the scheme in any case, then one or more spaces (RFC 6750 section 2.1).
_BEARER = re.compile(rb"(?i:bearer) +(\S+) *")


def read_api_keys(api_key: str | None, api_key_file: str | None) -> list[str]:
    """The accepted keys: ``api_key`` and one per non-empty line of ``api_key_file`` (``#`` comments).

    Raises:
        ValueError: a key is empty or contains whitespace, or the file has no key.
        OSError: the file cannot be read.
    """
    keys = [api_key] if api_key is not None else []
    if api_key_file is not None:
        lines = Path(api_key_file).read_text().splitlines()
        file_keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file {api_key_file} holds no key")
        keys += file_keys
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and contain no whitespace")
    return keys


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses Generation calls without ``authorization: Bearer <one of keys>`` with UNAUTHENTICATED.

    Args:
        keys: the accepted keys (at least one).
    """

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys: list[bytes] = []
        self.set_keys(keys)

    def set_keys(self, keys: Sequence[str]) -> None:
        """Replaces the accepted keys (on SIGHUP); calls in flight keep the answer they got.

        Raises:
            ValueError: ``keys`` is empty.
        """
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = [k.encode() for k in keys]  # one assignment: a concurrent check sees old or new keys

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for name, value in metadata or ():
            if name == "authorization":
                match = _BEARER.fullmatch(value.encode() if isinstance(value, str) else value)
                given = match.group(1) if match else b""
                # Compare with every key, without stopping early: the time taken says nothing.
                return sum(hmac.compare_digest(given, k) for k in self._keys) > 0
        return False

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_PROTECTED_PREFIX):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        log.warning("unauthenticated call refused", method=method)
        message = "missing or invalid API key: send metadata 'authorization: Bearer <key>'"

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator, as the stream handler must be

        serializers = dict(request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **serializers)
        return grpc.unary_unary_rpc_method_handler(deny, **serializers)
