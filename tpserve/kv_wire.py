"""The KV side channel's framing: what a rank's KV agent and its callers say to each other over TCP.

A message is a frame: a 4-byte big-endian length, that many bytes of a JSON object (the header),
then, when the header names ``payload_bytes`` = N, N raw bytes (a transfer's K/V). On accept the
agent sends ``{"nonce": <hex>}``; the caller's first frame carries ``"auth"``, the hex HMAC-SHA256 of
the nonce under the group's cluster secret (``--cluster-secret-file``; ``""`` without one), which
the agent checks in constant time before it reads anything else. Commands (``op``):

=========  =====================================  ==================================================
op         from                                   meaning
=========  =====================================  ==================================================
``hold``   the rank's own coordinator (producer)  keep blocks for a pull; answered twice: ``held``
                                                  at once, then ``done`` once the peer confirmed or
                                                  the hold timed out
``pull``   the rank's own coordinator (consumer)  read a transfer from the peer rank into local blocks
``read``   a peer rank's agent                    send a held transfer (after the checks), then wait
                                                  for the reader's ``ack``
=========  =====================================  ==================================================

Blocking helpers for the ranks' threads and asyncio ones for the coordinator. No torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

#: Largest header accepted (a pull names at most a sequence's blocks and hashes).
MAX_HEADER_BYTES = 4 * 1024 * 1024
_LENGTH = struct.Struct(">I")


class WireError(Exception):
    """A frame that is malformed, too large, cut short, or refused by the peer's authentication."""


def auth_digest(secret: str | None, nonce: str) -> str:
    """The ``auth`` field answering ``nonce``: HMAC-SHA256 under ``secret`` in hex, ``""`` without one."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def check_auth(secret: str | None, nonce: str, header: dict[str, Any]) -> bool:
    """Whether ``header``'s ``auth`` answers ``nonce`` under ``secret`` (constant-time)."""
    return hmac.compare_digest(str(header.get("auth", "")), auth_digest(secret, nonce))


def new_nonce() -> str:
    """A fresh 128-bit challenge, in hex."""
    return secrets.token_hex(16)


def encode_frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """The pieces of one frame (``payload_bytes`` is set from ``payload``)."""
    if payload:
        header = {**header, "payload_bytes": len(payload)}
    body = json.dumps(header, separators=(",", ":")).encode()
    return [_LENGTH.pack(len(body)) + body, payload] if payload else [_LENGTH.pack(len(body)) + body]


def _decode_header(body: bytes) -> dict[str, Any]:
    try:
        header = json.loads(body)
    except ValueError as exc:
        raise WireError(f"a frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("a frame header is not a JSON object")
    return header


def _header_length(prefix: bytes) -> int:
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise WireError(f"a frame header of {length} bytes is over the {MAX_HEADER_BYTES} accepted")
    return length


# -- blocking (the ranks' agent threads) ---------------------------------------------------------

def recv_exact(sock: socket.socket, num_bytes: int, into: bytearray | None = None) -> bytearray:
    """Exactly ``num_bytes`` from ``sock`` (into ``into`` when given).

    Raises:
        WireError: the peer closed the connection first.
    """
    buffer = into if into is not None else bytearray(num_bytes)
    view, got = memoryview(buffer), 0
    while got < num_bytes:
        n = sock.recv_into(view[got:num_bytes])
        if n == 0:
            raise WireError(f"the peer closed the connection after {got} of {num_bytes} bytes")
        got += n
    return buffer


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Sends one frame on a blocking socket."""
    for piece in encode_frame(header, payload):
        sock.sendall(piece)


def recv_frame(sock: socket.socket, max_payload_bytes: int = 0) -> tuple[dict[str, Any], bytearray]:
    """One frame from a blocking socket: its header and payload (empty when it has none).

    Raises:
        WireError: malformed, cut short, or a payload over ``max_payload_bytes``.
    """
    header = _decode_header(bytes(recv_exact(sock, _header_length(bytes(recv_exact(sock, 4))))))
    size = header.get("payload_bytes", 0)
    if not isinstance(size, int) or size < 0 or size > max_payload_bytes:
        raise WireError(f"a payload of {size!r} bytes where at most {max_payload_bytes} were expected")
    return header, recv_exact(sock, size) if size else bytearray()


def connect(host: str, port: int, secret: str | None, timeout_s: float) -> tuple[socket.socket, str]:
    """A blocking connection to an agent and the ``auth`` value its first frame must carry.

    Raises:
        OSError: cannot connect within ``timeout_s`` seconds.
        WireError: the agent's greeting is malformed.
    """
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello, _ = recv_frame(sock)
    except BaseException:
        sock.close()
        raise
    return sock, auth_digest(secret, str(hello.get("nonce", "")))


# -- asyncio (the coordinator) -------------------------------------------------------------------

async def open_async(host: str, port: int, secret: str | None,
                     timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """An asyncio connection to an agent: reader, writer and the ``auth`` value for the first frame.

    Raises:
        OSError, asyncio.TimeoutError: cannot connect within ``timeout_s`` seconds.
        WireError: the greeting is malformed.
    """
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        hello = await asyncio.wait_for(read_async(reader), timeout_s)
    except BaseException:
        writer.close()
        raise
    return reader, writer, auth_digest(secret, str(hello.get("nonce", "")))


async def read_async(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One header-only frame from an asyncio stream.

    Raises:
        WireError: malformed, cut short, or carrying a payload.
    """
    try:
        length = _header_length(await reader.readexactly(4))
        header = _decode_header(await reader.readexactly(length))
    except asyncio.IncompleteReadError as exc:
        raise WireError("the agent closed the connection") from exc
    if header.get("payload_bytes"):
        raise WireError("an unexpected payload on a control connection")
    return header


async def write_async(writer: asyncio.StreamWriter, header: dict[str, Any]) -> None:
    """Sends one header-only frame on an asyncio stream."""
    for piece in encode_frame(header):
        writer.write(piece)
    await writer.drain()
