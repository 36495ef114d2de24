"""Who may call the public API: TLS / mutual TLS credentials and bearer API keys with roles.

* TLS (``--ssl-certfile``, ``--ssl-keyfile``): the server proves its identity and the
  channel is encrypted. Mutual TLS (``--ssl-ca-certs``): a client must also present
  a certificate signed by that CA, or its handshake fails (the client sees
  UNAVAILABLE, the request never reaches a handler).
* API keys: every call of the Generation service and of the engine protocol carries
  ``authorization: Bearer <key>`` metadata (the scheme in any case: RFC 6750 section 2.1
  and RFC 9110 section 11.1 make it case-insensitive), or is refused with
  UNAUTHENTICATED; the refusals' warnings are rate-limited (tpserve/log.py). The health
  service and server reflection stay open, so that Kubernetes probes (which carry no
  token) keep working; they reveal nothing about requests. Keys are compared in constant
  time (``hmac.compare_digest``) and never logged.
* Roles (docs/design/security.md, "Two roles, one key check"): a key is a **tenant**'s (``--api-key``,
``--api-key-file``) or an
  **operator**'s (``--operator-api-key``, ``--operator-api-key-file``: a gateway, an
  administrator). A tenant generates, aborts its own requests and reads the model's
  facts; what acts on or shows other tenants is the operator's: the methods of
  :data:`OPERATOR_METHODS` (a tenant gets PERMISSION_DENIED naming the role), the
  server-wide fields of GetServerInfo, and priorities below the default 0
  (:func:`check_priority`). Without any key there is one trust domain: every caller is
  an operator, as before roles existed.

Key and certificate files are read at start-up and again on SIGHUP (rotation without a
restart: :class:`ApiKeyInterceptor.set_keys` here, the certificates in
:mod:`coordinator.tls`). No torch.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Sequence
from enum import Enum
from pathlib import Path

import grpc
import structlog

from coordinator.errors import PermissionDeniedError

log = structlog.get_logger(__name__)

#: The methods that need a key: everything of the tpserve Generation service and of the
#: engine protocol a gateway speaks (coordinator/vllm_engine_service.py; smg's --api-key).
_PROTECTED_PREFIX = ("/tpserve.v1.Generation/", "/vllm.grpc.engine.VllmEngine/")
#: ``Bearer <token>``: the scheme in any case, then one or more spaces (RFC 6750 section 2.1).
_BEARER = re.compile(rb"(?i:bearer) +(\S+) *")
_ENGINE = "/vllm.grpc.engine.VllmEngine/"
#: What only an operator may call: they act on, or show, every tenant's state (the prefix
#: cache's contents and events, the queue and cache hit rate) or the server itself.
OPERATOR_METHODS = frozenset(_ENGINE + name for name in (
    "FlushCache", "SubscribeKvEvents", "GetLoads", "StartProfile", "StopProfile")) | frozenset(
    # LoRA adapters: which are served changes every tenant's server (coordinator/lora_admin.py).
    "/tpserve.v1.Generation/" + name for name in ("LoadLoRAAdapter", "UnloadLoRAAdapter", "ListLoRAAdapters"))


class Role(Enum):
    """What a key may do (the module's docstring lists each role's calls)."""

    TENANT = "tenant"
    OPERATOR = "operator"


def read_api_keys(api_key: str | None, api_key_file: str | None, flag: str = "--api-key-file") -> list[str]:
    """The accepted keys: ``api_key`` and one per non-empty line of ``api_key_file`` (``#`` comments).

    ``flag`` names the file's flag in errors.

    Raises:
        ValueError: a key is empty or contains whitespace, or the file has no key.
        OSError: the file cannot be read.
    """
    keys = [api_key] if api_key is not None else []
    if api_key_file is not None:
        lines = Path(api_key_file).read_text().splitlines()
        file_keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not file_keys:
            raise ValueError(f"{flag} {api_key_file} holds no key")
        keys += file_keys
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and contain no whitespace")
    return keys


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <a key>`` (UNAUTHENTICATED) and the
    operator's methods to tenant keys (PERMISSION_DENIED).

    Args:
        keys: the tenants' keys.
        operator_keys: the operators' keys (a key in both lists is an operator's).
    """

    def __init__(self, keys: Sequence[str], operator_keys: Sequence[str] = ()) -> None:
        self._keys: list[tuple[bytes, Role]] = []
        self.set_keys(keys, operator_keys)

    def set_keys(self, keys: Sequence[str], operator_keys: Sequence[str] = ()) -> None:
        """Replaces the accepted keys (on SIGHUP); calls in flight keep the answer they got.

        Raises:
            ValueError: no key at all.
        """
        if not keys and not operator_keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        # Operators first: a key in both lists is an operator's.
        entries = [(k.encode(), Role.OPERATOR) for k in operator_keys] + [(k.encode(), Role.TENANT) for k in keys]
        self._keys = entries  # one assignment: a concurrent check sees old or new keys

    def role(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Role | None:
        """The role of the call's bearer key, or None when it carries no accepted key."""
        for name, value in metadata or ():
            if name == "authorization":
                match = _BEARER.fullmatch(value.encode() if isinstance(value, str) else value)
                given = match.group(1) if match else b""
                # Compare with every key, without stopping early: the time taken says nothing.
                roles = [role for key, role in self._keys if hmac.compare_digest(given, key)]
                return roles[0] if roles else None
        return None

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_PROTECTED_PREFIX):
            return handler
        role = self.role(handler_call_details.invocation_metadata)
        if role is Role.OPERATOR or (role is Role.TENANT and method not in OPERATOR_METHODS):
            return handler
        if role is None:
            log.warning("unauthenticated call refused", method=method)
            code, message = (grpc.StatusCode.UNAUTHENTICATED,
                             "missing or invalid API key: send metadata 'authorization: Bearer <key>'")
        else:
            log.warning("tenant call of an operator method refused", method=method)
            code, message = grpc.StatusCode.PERMISSION_DENIED, operator_only(method.rsplit("/", 1)[-1])

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(code, message)

        async def deny_stream(request, context: grpc.aio.ServicerContext):
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator, as the stream handler must be

        serializers = dict(request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **serializers)
        return grpc.unary_unary_rpc_method_handler(deny, **serializers)


def operator_only(what: str) -> str:
    """The PERMISSION_DENIED message for ``what`` (a method, a field value) asked with a tenant key."""
    return (f"{what} needs the operator role: call with an operator key (--operator-api-key, "
            f"--operator-api-key-file); this key is a tenant's")


def is_operator(keys: ApiKeyInterceptor | None, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """Whether the call may see and do what the operator may: always without API keys (one trust domain)."""
    return keys is None or keys.role(metadata) is Role.OPERATOR


def check_priority(priority: int, operator: bool) -> None:
    """Refuses a tenant's priority below the default 0 (more urgent than everyone's default):
    else any tenant could put its requests ahead of every other tenant's.

    Raises:
        PermissionDeniedError: ``priority`` < 0 and the caller is no operator.
    """
    if priority < 0 and not operator:
        raise PermissionDeniedError(operator_only(f"priority {priority} (below the default 0)")
                                    + "; a tenant may use 0 or above (later)")
