"""What a failed call means to its caller: :func:`describe_rpc_error`, one line with the status, the server's
message and, where the cause is likely on the caller's side, what to check. ``tpserve generate``, ``info`` and
``bench`` print it, and a client's ``wait_ready`` says it when it gives up (tpserve/client_calls.py)."""

from __future__ import annotations

import grpc


def describe_rpc_error(exc: grpc.RpcError, target: str, tls: bool = False) -> str:
    """One line for a failed call: the status code, the server's message and, where the cause is likely on
    the caller's side (no server there, a name that does not resolve, TLS on one side only, no API key), what to
    check."""
    code, details = exc.code(), exc.details() or ""
    line = f"{code.name}: {details}"
    lower = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if "errors resolving" in lower or "dns resolution failed" in lower:
            return f"{line} -- the name {host_of(target)} does not resolve: check --target HOST[:PORT]"
        if "connection refused" in lower or ("failed to connect" in lower and "ssl" not in lower):
            return (f"{line} -- no tpserve server answers at {target}: start one (tpserve serve) or check "
                    "--target HOST[:PORT]")
        if not tls and ("socket closed" in lower or "connection reset" in lower or "end of file" in lower):
            return (f"{line} -- the server at {target} closed the connection: if it was started with "
                    "--ssl-certfile, connect with TLS (--ssl-ca-certs CA.pem)")
        if tls and ("ssl" in lower or "handshake" in lower or "tls" in lower):
            return (f"{line} -- the TLS handshake with {target} failed: check --ssl-ca-certs (the CA that signed "
                    "the server's certificate), the client certificate if the server requires one, and that the "
                    "server serves TLS at all")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{line} -- give the server's API key with --api-key or $TPSERVE_API_KEY"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{line} -- the call took longer than its deadline (--timeout)"
    return line


def host_of(target: str) -> str:
    """The host a ``HOST:PORT`` target names (after ``dns:///`` or ``dns://server/``), without brackets."""
    name = target.rpartition("/")[2] if target.startswith("dns:") else target
    host, colon, _ = name.removeprefix("dns:").rpartition(":")
    return (host if colon else name).strip("[]")
