"""A rank's KV agent: its side-channel server, on threads of its own, never on the step thread.

Listens on ``side_channel_host:side_channel_port + rank`` (tpserve/kv_transfer_config.py) and
serves each connection on a thread (tpserve/kv_wire.py for the frames and the authentication:
``hold`` and ``pull`` only from a caller that proves the group's control key, which only this
rank's coordinator has; ``read`` from a caller that proves the cluster secret, when there is one;
every frame after the greeting tagged under the connection's session key):

- ``hold`` (its coordinator, prefill side): keep blocks ``block_ids`` with their hashes and
  namespace under ``transfer_id``; answer ``held``, then ``done`` with ``confirmed`` once the
  peer rank acknowledged its read, or when ``timeout_s`` passed, or when the coordinator sent
  ``release`` or hung up. Only then may the coordinator free the blocks: a read copies them
  under the hold's lock, so none is in progress once the hold is gone.
- ``read`` (the peer rank, decode side): the checks (a hold of that id, the same hashes,
  namespace, block ids, tensor-parallel degree and rank, cache layout), then the payload
  (worker/kv_transfer/blocks.py); the reader's ``ack`` confirms the hold. A read of no block
  (the decode replica had them all cached) only confirms it. A read of the hold's own request whose
  cache layout differs (another ``--kv-cache-dtype`` or calibration) ends the hold at once: no read
  of it can succeed, so its blocks are not kept for the hold's timeout.
- ``pull`` (its coordinator, decode side): pull a transfer from the peer rank into local
  blocks with the transport (worker/kv_transfer/transport.py); answer ``pulled`` with ``ok``,
  the bytes and seconds, or the error.

Holds live in memory only: a rank that restarts forgets them, and the peer's pull then fails
and falls back to a local prefill.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from tpserve.kv_wire import (CONTROL_OPS, FrameMac, WireError, new_nonce, purpose_of, recv_frame, recv_raw, send_frame,
                             session_key)
from worker.kv_transfer.blocks import KVCaches, gather_blocks, layout_mismatch, layout_signature
from worker.kv_transfer.transport import KVTransport, PullRequest, TransferRefused

log = structlog.get_logger(__name__)

#: Longest a connection may be silent before its first frame (a scanner holding a thread).
FIRST_FRAME_TIMEOUT_S = 10.0
#: Longest a command's own socket operation may wait (a reader's ack): no peer holds a thread for ever.
COMMAND_TIMEOUT_S = 60.0
#: Connections served at once; past it a new one is closed at once (a flood cannot take the rank's threads).
MAX_CONNECTIONS = 256


@dataclass
class _Hold:
    block_ids: list[int]
    block_hashes: list[str]
    namespace: str
    bytes_sent: int = 0
    blocks_sent: int = 0
    active: bool = True  # False once released: its blocks may be reused
    lock: threading.Lock = field(default_factory=threading.Lock)  # a read's copy against the release
    confirmed: threading.Event = field(default_factory=threading.Event)
    abandoned: threading.Event = field(default_factory=threading.Event)  # its reader's cache cannot take the blocks


class KVAgent:
    """Serves one rank's side channel.

    Args:
        host, port: where to listen (``port`` is this rank's: the replica's base port + rank).
        tp_rank, tp_size: this rank's place; a reader of another degree or rank is refused.
        secret: the cluster secret a peer's ``read`` must prove (None: reads are not authenticated; the
            configuration then keeps the side channel on loopback).
        caches: returns the rank's KV cache tensors now (empty before InitCache): every tensor a block id
            indexes (an 8-bit cache's scale pools too).
        transport: what ``pull`` uses.
        codec: returns what the cache's codes mean beyond their bytes ("" for a float cache; an 8-bit
            cache's storage type and key offsets, ``ModelRunner.kv_codec``): part of the layout a peer must share.

    Raises:
        OSError: the port cannot be bound (from :meth:`start`).
    """

    def __init__(self, host: str, port: int, tp_rank: int, tp_size: int, secret: str | None,
                 caches: Callable[[], KVCaches], transport: KVTransport,
                 codec: Callable[[], str] | None = None, control_key: str | None = None) -> None:
        self.host, self.port, self.tp_rank, self.tp_size = host, port, tp_rank, tp_size
        self.control_key = control_key
        self.secret, self.caches, self.transport = secret, caches, transport
        self.codec: Callable[[], str] = codec or (lambda: "")
        self._holds: dict[str, _Hold] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    @property
    def num_holds(self) -> int:
        """Transfers held now."""
        return len(self._holds)

    def start(self) -> None:
        """Binds and starts accepting on a daemon thread."""
        sock = socket.create_server((self.host, self.port), reuse_port=False)
        sock.settimeout(0.5)
        self._sock = sock
        threading.Thread(target=self._accept, name=f"kv-agent-{self.tp_rank}", daemon=True).start()
        log.info("kv agent listening", host=self.host, port=self.port, transport=self.transport.name)

    def close(self) -> None:
        """Stops accepting (connections in flight end on their own)."""
        self._closed.set()
        if self._sock is not None:
            self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()  # type: ignore[union-attr]
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("kv side channel full: a connection refused", max_connections=MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-conn-{self.tp_rank}", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._handle(conn)
            finally:
                self._slots.release()

    def _handle(self, conn: socket.socket) -> None:
        """Authenticates the caller (its first frame's op says which key), then runs its one command
        (errors end the connection, logged)."""
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(FIRST_FRAME_TIMEOUT_S)
            nonce = new_nonce()
            send_frame(conn, {"nonce": nonce})
            header, body, payload, tag = recv_raw(conn)
            op = str(header.get("op"))
            handler = {"hold": self._hold, "read": self._read, "pull": self._pull}.get(op)
            if handler is None:
                send_frame(conn, {"ok": False, "error": f"unknown op {op!r}"})
                return
            refusal = self._authenticate(op, nonce, header, body, payload, tag)
            if isinstance(refusal, str):
                log.warning("kv side channel caller refused", op=op, reason=refusal)
                send_frame(conn, {"ok": False, "error": refusal})
                return
            conn.settimeout(COMMAND_TIMEOUT_S)
            handler(conn, header, refusal)
        except (OSError, WireError, ValueError, KeyError, TypeError) as exc:
            log.warning("kv side channel connection failed", error=f"{type(exc).__name__}: {exc}")

    def _authenticate(self, op: str, nonce: str, header: dict[str, Any], body: bytes, payload: bytearray | memoryview,
                      tag: bytes | None) -> FrameMac | str:
        """The connection's tags once the first frame proved its op's key, or why it did not (a str).

        ``hold``/``pull`` need the control key (only this rank's coordinator has it: never the cluster
        secret, which every replica of the fleet shares); ``read`` the cluster secret, if any."""
        control = op in CONTROL_OPS
        key = self.control_key if control else self.secret
        if control and not key:
            return "this rank has no control key: hold and pull come only from its own coordinator"
        try:
            mac = FrameMac(session_key(key, purpose_of(op), nonce, str(header.get("nonce", ""))), agent=True)
            if tag is None and key:  # an untagged refusal passes FrameMac.check; a command must be tagged
                raise WireError("untagged")
            mac.check(header, body, payload, tag)
        except WireError:
            return ("hold and pull come only from this rank's own coordinator" if control
                    else "missing or wrong cluster secret")
        return mac

    # -- producer side ---------------------------------------------------------------------------

    def _hold(self, conn: socket.socket, header: dict[str, Any], mac: FrameMac) -> None:
        transfer_id = str(header["transfer_id"])
        hold = _Hold([int(b) for b in header["block_ids"]], [str(h) for h in header["block_hashes"]],
                     str(header["namespace"]))
        deadline = time.monotonic() + float(header["timeout_s"])
        with self._lock:
            self._holds[transfer_id] = hold
        try:
            send_frame(conn, {"op": "held", "ok": True}, mac=mac)
            while not hold.confirmed.wait(0.05):
                if time.monotonic() > deadline or hold.abandoned.is_set():
                    break
                readable, _, _ = select.select([conn], [], [], 0)
                if readable:  # "release", or the coordinator hung up: either way the hold ends (ending a
                    # hold early is the safe direction, so the frame itself need not be read)
                    break
        finally:
            with self._lock:
                self._holds.pop(transfer_id, None)
            with hold.lock:  # waits for a read copying these blocks: none copies them once this returns
                hold.active = False
        send_frame(conn, {"op": "done", "confirmed": hold.confirmed.is_set(), "bytes": hold.bytes_sent,
                          "blocks": hold.blocks_sent}, mac=mac)

    def _read(self, conn: socket.socket, header: dict[str, Any], mac: FrameMac) -> None:
        transfer_id = str(header.get("transfer_id"))
        chosen, payload = slice(0, 0), b""
        with self._lock:
            hold = self._holds.get(transfer_id)
        caches = self.caches()
        problem = self._read_problem(hold, header, caches)
        if problem and hold is not None and header.get("namespace") == hold.namespace and caches \
                and header.get("layout") != self._layout(caches):
            # The hold's own request, read by a replica whose cache cannot take these blocks (another
            # --kv-cache-dtype or calibration): no read of it will succeed, so it ends now, its blocks freed.
            hold.abandoned.set()
        if not problem and hold is not None:
            with hold.lock:  # one hold's reads and its release in turn; other holds go on meanwhile
                if hold.active:
                    first = int(header["first_block"])
                    chosen = slice(first, first + len(header["block_hashes"]))
                    payload = gather_blocks(caches, hold.block_ids[chosen])
                else:
                    problem = "no such transfer held here (released, timed out, or never held)"
        if problem or hold is None:
            log.warning("kv read refused", transfer_id=transfer_id, reason=problem)
            send_frame(conn, {"ok": False, "error": problem}, mac=mac)
            return
        send_frame(conn, {"ok": True, "block_hashes": hold.block_hashes[chosen], "namespace": hold.namespace,
                          "layout": self._layout(caches)}, payload, mac=mac)
        answer, _ = recv_frame(conn, mac=mac)
        if answer.get("op") == "ack":
            hold.bytes_sent += len(payload)
            hold.blocks_sent += chosen.stop - chosen.start
            hold.confirmed.set()

    def _read_problem(self, hold: _Hold | None, header: dict[str, Any], caches: KVCaches) -> str:
        """Why a read is refused ("" when it is served): the sender's checks, before a byte leaves."""
        if hold is None:
            return "no such transfer held here (released, timed out, or never held)"
        if header.get("tp_size") != self.tp_size or header.get("tp_rank") != self.tp_rank:
            return (f"tensor-parallel rank {header.get('tp_rank')} of {header.get('tp_size')} cannot read rank "
                    f"{self.tp_rank} of {self.tp_size}: equal degrees are required")
        if header.get("namespace") != hold.namespace:
            return "another namespace's transfer"
        hashes, first = header.get("block_hashes"), header.get("first_block")
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            return "first_block must be an index into the hold"
        if not isinstance(hashes, list) or hashes != hold.block_hashes[first:first + len(hashes)]:
            return "the block hashes are not the held blocks'"
        if header.get("block_ids") != hold.block_ids[first:first + len(hashes)]:
            return "the block ids are not the held blocks'"
        if not caches:
            return "this rank has no KV cache now"
        if header.get("layout") != self._layout(caches):
            return layout_mismatch(str(header.get("layout")), self._layout(caches))
        return ""

    def _layout(self, caches: KVCaches) -> str:
        """This rank's layout signature: the tensors' shapes and dtypes, and the codec."""
        return layout_signature(caches, self.codec())

    # -- consumer side ---------------------------------------------------------------------------

    def _pull(self, conn: socket.socket, header: dict[str, Any], mac: FrameMac) -> None:
        request = PullRequest(
            transfer_id=str(header["transfer_id"]), remote_host=str(header["remote_host"]),
            remote_port=int(header["remote_port"]) + self.tp_rank, first_block=int(header["first_block"]),
            remote_block_ids=[int(b) for b in header["remote_block_ids"]],
            local_block_ids=[int(b) for b in header["local_block_ids"]],
            block_hashes=[str(h) for h in header["block_hashes"]], namespace=str(header["namespace"]),
            timeout_s=float(header["timeout_s"]))
        started = time.monotonic()
        try:
            caches = self.caches()
            if not caches:
                raise TransferRefused("this rank has no KV cache now")
            num_bytes = self.transport.pull(request, caches, self._layout(caches))
        except (TransferRefused, OSError, WireError, ValueError) as exc:
            send_frame(conn, {"op": "pulled", "ok": False, "error": f"{type(exc).__name__}: {exc}"}, mac=mac)
            return
        send_frame(conn, {"op": "pulled", "ok": True, "bytes": num_bytes,
                          "seconds": time.monotonic() - started}, mac=mac)
