"""Transports: how a rank pulls its K/V slice of a transfer from the same rank of another replica.

One interface (:class:`KVTransport`), two transports:

- :class:`TcpTransport`: the payload over the agents' side channel (tpserve/kv_wire.py), for CPU
  ranks, tests and any host pair that reaches each other over TCP; a GPU cache is staged
  through host memory.
- NIXL (``transport: nixl``; the nixl package, CUDA ranks): registered GPU memory read directly
  by the decode rank. Not built yet: chosen only where the package is installed, and refused
  here with one line (:func:`make_transport`); tpserve/kv_transfer_config.py refuses it first.

A pull is checked before its bytes are written: the holder's block hashes and namespace must be
the ones the receiving coordinator computed for its own request, and the cache layouts equal. With
a cluster secret the holder must also prove it (every frame of its answer, the K/V included, is
tagged under the connection's session key: tpserve/kv_wire.py), so an address a request names
cannot feed this rank K/V of its own making; without one, only a loopback holder is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tpserve.kv_wire import caller_session, connect, recv_frame, send_frame, unauthenticated_peer_refusal
from worker.kv_transfer.blocks import KVCaches, bytes_per_block, layout_signature, scatter_blocks


@dataclass(frozen=True)
class PullRequest:
    """What a consumer rank pulls: one transfer's blocks, into its own blocks.

    Attributes:
        transfer_id: the producer's hold (``remote_request_id`` of the kv_transfer_params).
        remote_host, remote_port: the producer rank's agent (its replica's side channel port + rank).
        first_block: the index in the hold of the first block pulled (the ones before it are
            cached here already).
        remote_block_ids: the producer's block ids from ``first_block`` on, in order.
        local_block_ids: where they go here (same length).
        block_hashes: hex SHA-256 chain hashes the receiving coordinator computed for its request.
        namespace: hex namespace digest of the request (tenant, salt, adapter).
        timeout_s: seconds for the whole pull.
    """

    transfer_id: str
    remote_host: str
    remote_port: int
    first_block: int
    remote_block_ids: list[int]
    local_block_ids: list[int]
    block_hashes: list[str]
    namespace: str
    timeout_s: float


class TransferRefused(Exception):
    """The producer refused the pull, or its answer failed a check (hashes, namespace, layout, size)."""


class KVTransport(Protocol):
    """Moves one transfer's blocks from a producer rank into this rank's cache."""

    name: str

    def pull(self, request: PullRequest, caches: KVCaches, layout: str | None = None) -> int:
        """Pulls ``request`` into ``caches``; returns the bytes received. ``layout``: the caches'
        :func:`~worker.kv_transfer.blocks.layout_signature` with this rank's codec (None: without one).

        Raises:
            TransferRefused: a check failed (nothing was written).
            OSError, WireError: the producer could not be reached or the connection broke.
        """
        ...


class TcpTransport:
    """The payload over the side channel (tpserve/kv_wire.py), checked, then written with index_copy_."""

    name = "tcp"

    def __init__(self, tp_rank: int, tp_size: int, secret: str | None) -> None:
        self.tp_rank, self.tp_size, self.secret = tp_rank, tp_size, secret

    def pull(self, request: PullRequest, caches: KVCaches, layout: str | None = None) -> int:
        """See :meth:`KVTransport.pull`. Without a cluster secret a holder off loopback is refused before
        any connection (:func:`unauthenticated_peer_refusal`)."""
        deadline = time.monotonic() + request.timeout_s
        layout = layout_signature(caches) if layout is None else layout
        if not self.secret:
            refusal = unauthenticated_peer_refusal(request.remote_host)
            if refusal:
                raise TransferRefused(refusal)
        sock, agent_nonce = connect(request.remote_host, request.remote_port, request.timeout_s)
        with sock:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            nonce, mac = caller_session(self.secret, "read", agent_nonce)
            send_frame(sock, {"op": "read", "nonce": nonce, "transfer_id": request.transfer_id,
                              "block_hashes": request.block_hashes, "namespace": request.namespace,
                              "first_block": request.first_block,
                              "block_ids": request.remote_block_ids, "tp_rank": self.tp_rank,
                              "tp_size": self.tp_size, "layout": layout}, mac=mac)
            expected = len(request.local_block_ids) * bytes_per_block(caches)
            header, payload = recv_frame(sock, max_payload_bytes=expected, mac=mac)  # K/V checked before use
            problem = _check_answer(header, request, layout, len(payload), expected)
            if problem:
                raise TransferRefused(problem)
            scatter_blocks(caches, request.local_block_ids, payload)
            send_frame(sock, {"op": "ack"}, mac=mac)
            return len(payload)


def _check_answer(header: dict[str, Any], request: PullRequest, layout: str, size: int, expected: int) -> str:
    """Why the producer's answer cannot be written ("" when it can): the receiver's own checks."""
    if not header.get("ok"):
        return f"the producer refused: {header.get('error', 'no reason given')}"
    if header.get("block_hashes") != request.block_hashes:
        return "the producer's block hashes are not this request's"
    if header.get("namespace") != request.namespace:
        return "the producer's blocks are of another namespace"
    if header.get("layout") != layout:
        return f"the producer's cache layout {header.get('layout')} is not this rank's {layout}"
    if size != expected:
        return f"{size} bytes received for {expected} expected"
    return ""


def make_transport(name: str, tp_rank: int, tp_size: int, secret: str | None,
                   find_spec: Callable[[str], object] | None = None) -> KVTransport:
    """The transport ``name`` (``tcp`` or ``nixl``) for this rank.

    Raises:
        ValueError: an unknown name, or ``nixl`` (with the reason: the package is missing, or
            the NIXL transport is not built yet).
    """
    if name == "tcp":
        return TcpTransport(tp_rank, tp_size, secret)
    if name == "nixl":
        import importlib.util

        if (find_spec or importlib.util.find_spec)("nixl") is None:
            raise ValueError("transport nixl needs the nixl package, which is not installed (pip install nixl)")
        raise ValueError("transport nixl is not built yet in this release; use transport tcp")
    raise ValueError(f"unknown KV transport {name!r}; use tcp or nixl")

