"""The KV side channel's framing and authentication: what a rank's KV agent and its callers say over TCP.

A message is a frame: a 4-byte big-endian length, that many bytes of a JSON object (the header),
then, when the header names ``payload_bytes`` = N, N raw bytes (a transfer's K/V), then, when the
header says ``"mac": true``, a 32-byte tag (below). Commands (``op``):

=========  =====================================  ==================================================
op         from                                   meaning
=========  =====================================  ==================================================
``hold``   the rank's own coordinator (producer)  keep blocks for a pull; answered twice: ``held``
                                                  at once, then ``done`` once the peer confirmed or
                                                  the hold timed out (``release`` ends it sooner)
``pull``   the rank's own coordinator (consumer)  read a transfer from the peer rank into local blocks
``read``   a peer rank's agent                    send a held transfer (after the checks), then wait
                                                  for the reader's ``ack``
=========  =====================================  ==================================================

**Authentication** (docs/design/security.md, "The KV side channel"). On accept the agent sends
``{"nonce": Na}``; the caller's first frame carries the command and its own fresh ``nonce`` Nc. Both
sides derive a session key from a long-term key and both nonces (:func:`session_key`), and every
frame after the greeting, in both directions, carries a tag: keyed BLAKE2b under the session key
over the direction, a per-direction sequence number, the header's bytes and the payload
(:class:`FrameMac`). The caller's first tag proves the key on the agent's fresh nonce, the agent's
first answer proves it on the caller's, so each side authenticates the other, and a relay in
between can neither replay, reorder, inject nor alter a frame (it can still read them: nothing is
encrypted). Two long-term keys, never mixed (the purpose is part of the derivation):

- ``control`` (``hold``, ``pull``): the *group's control key*, random per launch, which the
  launcher hands to its ranks and its coordinator only (launch/local_ranks.py, ``KV_CONTROL_KEY_ENV``):
  no one else can make a rank hold, release or pull, whatever the cluster secret;
- ``read`` (``read``): the cluster secret (``--cluster-secret-file``), shared by the replicas of a
  fleet. Without one, reads are not authenticated: the configuration then keeps the side channel
  on loopback (tpserve/kv_transfer_config.py) and a decode replica caches what it pulled only for
  the request that pulled it (coordinator/kv_transfer/connector.py).

A refusal (``{"ok": false, "error": ...}``) may come untagged (before a session exists); a caller
only ever treats it as a refusal. Blocking helpers for the ranks' threads and asyncio ones for the
coordinator. No torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import secrets
import socket
import struct
from typing import Any

#: Largest header accepted (a pull names at most a sequence's blocks and hashes).
MAX_HEADER_BYTES = 4 * 1024 * 1024
#: Bytes of a frame's tag (keyed BLAKE2b-256).
TAG_BYTES = 32
#: A tagged payload is sent and received in pieces of this size, each hashed as it goes: the sender's and the
#: receiver's hashing overlap each other and the transfer instead of adding two whole passes to it.
CHUNK_BYTES = 1 << 20
#: The derivation's label: another protocol version derives other keys.
PROTOCOL = b"tpserve-kv/2"
#: Where a rank finds the group's control key (launch/local_ranks.py sets it, worker/main.py takes it).
KV_CONTROL_KEY_ENV = "TPSERVE_KV_CONTROL_KEY"
#: The ops each long-term key authenticates.
CONTROL_OPS = frozenset({"hold", "pull"})
PEER_OPS = frozenset({"read"})
_LENGTH = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_NONCE_HEX = 32


class WireError(Exception):
    """A frame that is malformed, too large, cut short, or that fails its authentication."""


def new_nonce() -> str:
    """A fresh 128-bit challenge, in hex."""
    return secrets.token_hex(16)


def new_control_key() -> str:
    """A group's control key: 256 random bits in hex, made by the launcher once per launch."""
    return secrets.token_hex(32)


def purpose_of(op: str) -> str:
    """``control`` for the coordinator's ops, ``read`` for a peer's (the key that authenticates ``op``).

    Raises:
        WireError: an unknown op.
    """
    if op in CONTROL_OPS:
        return "control"
    if op in PEER_OPS:
        return "read"
    raise WireError(f"unknown op {op!r}")


def session_key(key: str | bytes | None, purpose: str, agent_nonce: str, caller_nonce: str) -> bytes | None:
    """The session key of one connection: HMAC-SHA256 of the purpose and both nonces under ``key``
    (None without a key: frames then carry no tag).

    Raises:
        WireError: a nonce that is not 128 bits of hex (a fresh nonce is what makes a session unique).
    """
    if not key:
        return None
    for nonce in (agent_nonce, caller_nonce):
        if not isinstance(nonce, str) or len(nonce) != _NONCE_HEX or not all(c in "0123456789abcdef" for c in nonce):
            raise WireError("a nonce must be 32 lowercase hex digits")
    raw = key.encode() if isinstance(key, str) else key
    return hmac.new(raw, b"|".join((PROTOCOL, purpose.encode(), agent_nonce.encode(), caller_nonce.encode())),
                    hashlib.sha256).digest()


class FrameMac:
    """One side's tags of one connection's frames: sequence numbers per direction, so a frame cannot be
    replayed, dropped or reordered unnoticed, and the direction in the tag, so none can be reflected.

    Args:
        key: the session key (:func:`session_key`); None: frames carry no tag (no key configured).
        agent: True on the agent's side (it sends ``A`` frames and receives ``C`` ones).
    """

    __slots__ = ("key", "_send", "_recv", "_sent", "_received")

    def __init__(self, key: bytes | None, agent: bool) -> None:
        self.key = key
        self._send, self._recv = (b"A", b"C") if agent else (b"C", b"A")
        self._sent = self._received = 0

    @property
    def keyed(self) -> bool:
        """Whether frames carry tags."""
        return self.key is not None

    def _digest(self, direction: bytes, seq: int, body: bytes) -> Any:
        assert self.key is not None  # only a keyed session tags frames (:attr:`keyed`)
        return hashlib.blake2b(direction + _SEQ.pack(seq) + _LENGTH.pack(len(body)) + body, key=self.key,
                               digest_size=TAG_BYTES)

    def start_seal(self, body: bytes) -> Any:
        """The running tag of the next frame sent, its header's bytes taken in: ``update`` it with the
        payload as it goes out (the K/V then costs one pass, overlapped with the sending), then send its
        ``digest()``. Only with a key."""
        digest = self._digest(self._send, self._sent, body)
        self._sent += 1
        return digest

    def seal(self, body: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        """The tag of the next frame sent (b"" without a key)."""
        if self.key is None:
            return b""
        digest = self.start_seal(body)
        if payload:
            digest.update(payload)  # releases the GIL over large buffers
        return digest.digest()

    def start_check(self, body: bytes) -> Any:
        """The running tag of the next frame received, its header's bytes taken in: ``update`` it with the
        payload as it arrives, then :meth:`finish_check` it. Only with a key."""
        return self._digest(self._recv, self._received, body)

    def finish_check(self, digest: Any, tag: bytes) -> None:
        """Compares :meth:`start_check`'s tag, updated with the whole payload, to the frame's (constant-time).

        Raises:
            WireError: they differ.
        """
        if not hmac.compare_digest(tag, digest.digest()):
            raise WireError("a frame failed its authentication (wrong key, or altered, replayed or reordered "
                            "on the way)")
        self._received += 1

    def check(self, header: dict[str, Any], body: bytes, payload: bytes | bytearray | memoryview,
              tag: bytes | None) -> None:
        """Checks the next frame received (constant-time).

        Raises:
            WireError: a keyed session's frame without a valid tag (an untagged refusal excepted: it
                is returned to the caller, who only ever takes it as a refusal), or a tag where none
                was agreed.
        """
        if self.key is None:
            if tag is not None:
                raise WireError("the peer authenticates its frames with a secret this side does not have "
                                "(give both replicas the same --cluster-secret-file)")
            return
        if tag is None:
            if header.get("ok") is False and not payload:
                return
            raise WireError("an unauthenticated frame on an authenticated connection")
        digest = self.start_check(body)
        if payload:
            digest.update(payload)
        self.finish_check(digest, tag)


def encode_frame(header: dict[str, Any], payload: bytes | bytearray | memoryview = b"",
                 mac: FrameMac | None = None) -> list[bytes | bytearray | memoryview]:
    """The pieces of one frame (``payload_bytes`` is set from ``payload``; ``mac`` set and its tag
    appended when ``mac`` is keyed)."""
    if payload:
        header = {**header, "payload_bytes": len(payload)}
    keyed = mac is not None and mac.keyed
    if keyed:
        header = {**header, "mac": True}
    body = json.dumps(header, separators=(",", ":")).encode()
    pieces: list[bytes | bytearray | memoryview] = [_LENGTH.pack(len(body)) + body]
    if payload:
        pieces.append(payload)
    if keyed:
        pieces.append(mac.seal(body, payload))  # type: ignore[union-attr]
    return pieces


def caller_session(key: str | bytes | None, op: str, agent_nonce: str) -> tuple[str, FrameMac]:
    """The caller's side of a new connection: its own fresh nonce (sent in its first frame) and the
    tags of the session keyed by ``key`` for ``op``'s purpose.

    Raises:
        WireError: the agent's greeting named no valid nonce.
    """
    nonce = new_nonce()
    return nonce, FrameMac(session_key(key, purpose_of(op), agent_nonce, nonce), agent=False)


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


def _payload_size(header: dict[str, Any], max_payload_bytes: int) -> int:
    size = header.get("payload_bytes", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size > max_payload_bytes:
        raise WireError(f"a payload of {size!r} bytes where at most {max_payload_bytes} were expected")
    return size


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (``localhost``, 127.0.0.0/8, ::1): no other host reaches it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unauthenticated_peer_refusal(host: str) -> str:
    """Why a holder at ``host`` may not be read without a cluster secret ("" when it may): off loopback its
    answer proves nothing, and the address came with the request (anyone's to choose)."""
    if is_loopback(host):
        return ""
    return (f"remote_host {host} is not loopback, and without --cluster-secret-file its K/V cannot be "
            "authenticated: give both replicas the same --cluster-secret-file")


# -- blocking (the ranks' agent threads) ---------------------------------------------------------

def recv_exact(sock: socket.socket, num_bytes: int, into: bytearray | memoryview | None = None) -> bytearray | memoryview:
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


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | bytearray | memoryview = b"",
               mac: FrameMac | None = None) -> None:
    """Sends one frame on a blocking socket (tagged when ``mac`` is keyed; a large payload hashed piece by
    piece as it is sent)."""
    if mac is None or not mac.keyed or len(payload) <= CHUNK_BYTES:
        for piece in encode_frame(header, payload, mac):
            sock.sendall(piece)
        return
    body = json.dumps({**header, "payload_bytes": len(payload), "mac": True}, separators=(",", ":")).encode()
    digest = mac.start_seal(body)
    sock.sendall(_LENGTH.pack(len(body)) + body)
    view = memoryview(payload)
    for start in range(0, len(view), CHUNK_BYTES):
        piece = view[start:start + CHUNK_BYTES]
        digest.update(piece)
        sock.sendall(piece)
    sock.sendall(digest.digest())


def recv_raw(sock: socket.socket, max_payload_bytes: int = 0
             ) -> tuple[dict[str, Any], bytes, bytearray | memoryview, bytes | None]:
    """One frame as it came: header, the header's bytes, payload, tag (None when the header says none).
    Unauthenticated: for the agent's first frame, whose op says which key checks it.

    Raises:
        WireError: malformed, cut short, or a payload over ``max_payload_bytes``.
    """
    body = bytes(recv_exact(sock, _header_length(bytes(recv_exact(sock, 4)))))
    header = _decode_header(body)
    size = _payload_size(header, max_payload_bytes)
    payload = recv_exact(sock, size) if size else bytearray()
    tag = bytes(recv_exact(sock, TAG_BYTES)) if header.get("mac") is True else None
    return header, body, payload, tag


def recv_frame(sock: socket.socket, max_payload_bytes: int = 0,
               mac: FrameMac | None = None) -> tuple[dict[str, Any], bytearray | memoryview]:
    """One frame from a blocking socket, checked against ``mac``: its header and payload (empty when none).

    Raises:
        WireError: malformed, cut short, a payload over ``max_payload_bytes``, or failing :meth:`FrameMac.check`
            (without ``mac``: any tagged frame).
    """
    mac = mac or FrameMac(None, agent=False)
    body = bytes(recv_exact(sock, _header_length(bytes(recv_exact(sock, 4)))))
    header = _decode_header(body)
    size = _payload_size(header, max_payload_bytes)
    if not (mac.keyed and header.get("mac") is True and size):
        payload = recv_exact(sock, size) if size else bytearray()
        tag = bytes(recv_exact(sock, TAG_BYTES)) if header.get("mac") is True else None
        mac.check(header, body, payload, tag)
        return header, payload
    digest = mac.start_check(body)  # hashed as it arrives, overlapping the sender's hashing and the transfer
    payload = bytearray(size)
    view = memoryview(payload)
    for start in range(0, size, CHUNK_BYTES):
        piece = view[start:min(start + CHUNK_BYTES, size)]
        recv_exact(sock, len(piece), piece)
        digest.update(piece)
    mac.finish_check(digest, bytes(recv_exact(sock, TAG_BYTES)))
    return header, payload


def connect(host: str, port: int, timeout_s: float) -> tuple[socket.socket, str]:
    """A blocking connection to an agent and the nonce of its greeting.

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
    return sock, str(hello.get("nonce", ""))


# -- asyncio (the coordinator) -------------------------------------------------------------------

async def open_async(host: str, port: int, timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """An asyncio connection to an agent: reader, writer and the nonce of its greeting.

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
    return reader, writer, str(hello.get("nonce", ""))


async def read_async(reader: asyncio.StreamReader, mac: FrameMac | None = None) -> dict[str, Any]:
    """One header-only frame from an asyncio stream, checked against ``mac``.

    Raises:
        WireError: malformed, cut short, carrying a payload, or failing :meth:`FrameMac.check`.
    """
    try:
        body = await reader.readexactly(_header_length(await reader.readexactly(4)))
        header = _decode_header(body)
        if header.get("payload_bytes"):
            raise WireError("an unexpected payload on a control connection")
        tag = await reader.readexactly(TAG_BYTES) if header.get("mac") is True else None
    except asyncio.IncompleteReadError as exc:
        raise WireError("the agent closed the connection") from exc
    (mac or FrameMac(None, agent=False)).check(header, body, b"", tag)
    return header


async def write_async(writer: asyncio.StreamWriter, header: dict[str, Any], mac: FrameMac | None = None) -> None:
    """Sends one header-only frame on an asyncio stream (tagged when ``mac`` is keyed)."""
    for piece in encode_frame(header, b"", mac):
        writer.write(piece)
    await writer.drain()
