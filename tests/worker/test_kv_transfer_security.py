"""The KV side channel under attack, at the wire: real KVAgents and the real KVConnector over loopback
(tests/worker/kv_replicas.py), against a fake agent and a relay in between.

What a probe found on the side channel of a tp-2 pair with a cluster secret (docs/design/security.md,
"The KV side channel"): a decode rank dialled whatever ``remote_host``/``remote_port`` a request named
and wrote whatever came back into the prefix cache (the agent's answers were never authenticated), and
a relay could turn the decode rank's proof of the secret into its own ``hold``/``read`` on the real
agent; without a secret anyone could ``hold`` and ``read`` any block.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from coordinator.errors import ResourceExhaustedError
from coordinator.kv_cache_manager import prompt_block_hashes
from coordinator.kv_transfer.params import parse_params
from tests.e2e.pd import free_port_range
from tests.worker.kv_replicas import (BLOCK_SIZE, CONTROL, NUM_BLOCKS, PROMPT, SECRET, TP, Replica, make_replica,
                                      prefill_blocks, until)
from tpserve.kv_wire import (TAG_BYTES, FrameMac, WireError, caller_session, connect, encode_frame, new_nonce,
                             recv_frame, recv_raw, send_frame, session_key)


def _close(*replicas: Replica) -> None:
    for replica in replicas:
        for agent in replica.agents:
            agent.close()


def _hand_over(prefill: Replica, namespace: bytes = b""):
    async def run():
        prefill_blocks(prefill, namespace)
        return parse_params(await prefill.connector.hand_over(prefill.scheduler, PROMPT, namespace))
    return asyncio.run(run())


def _pull_via(decode, handle: Callable[[socket.socket, int], None], remote_block_ids, remote_request_id: str):
    """The decode replica's pull of ``PROMPT`` from ``remote_block_ids``, its ranks dialling ``handle`` (a fake
    agent or a relay, :func:`_serve`) where the params name the prefill's agents."""
    port = free_port_range(TP)
    stop = _serve(port, handle)
    try:
        return asyncio.run(decode.connector.pull(decode.scheduler, PROMPT, b"", parse_params(json.dumps(
            {"do_remote_prefill": True, "remote_block_ids": list(remote_block_ids), "remote_host": "127.0.0.1",
             "remote_port": port, "remote_request_id": remote_request_id, "tp_size": TP,
             "block_size": BLOCK_SIZE}))))
    finally:
        stop()


def _serve(port_base: int, handle: Callable[[socket.socket, int], None]) -> Callable[[], None]:
    """Listens on ``port_base + rank`` for every rank, each connection to ``handle(conn, rank)`` on a thread;
    returns what stops it."""
    servers = [socket.create_server(("127.0.0.1", port_base + rank)) for rank in range(TP)]
    stop = threading.Event()

    def accept(server: socket.socket, rank: int) -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=lambda: _quietly(handle, conn, rank), daemon=True).start()

    for rank, server in enumerate(servers):
        threading.Thread(target=accept, args=(server, rank), daemon=True).start()

    def close() -> None:
        stop.set()
        for server in servers:
            server.close()
    return close


def _quietly(handle: Callable[[socket.socket, int], None], conn: socket.socket, rank: int) -> None:
    with conn:
        try:
            handle(conn, rank)
        except (OSError, WireError):
            pass


def _raw_frame(header: dict, tag: bytes | None = None, payload: bytes = b"") -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body + payload + (tag or b"")


@pytest.fixture
def pair() -> Iterator[tuple[Replica, Replica]]:
    prefill, decode = make_replica("kv_producer", 1, hold_timeout_s=5.0), make_replica("kv_consumer", 2, pull_timeout_s=2.0)
    yield prefill, decode
    _close(prefill, decode)


def _decode_blocks_unchanged(decode: Replica, before) -> bool:
    return all(torch.equal(k, k0) and torch.equal(v, v0) for rank in range(TP)
               for (k, v), (k0, v0) in zip(decode.caches[rank], before[rank]))


def test_a_fake_agent_cannot_feed_a_decode_rank_kv_of_its_own(pair) -> None:
    """F1 (poisoning): a request names an attacker's address; the attacker answers every read with K/V of its
    choosing, echoing the hashes, namespace and layout asked for. Nothing is written or cached: its answer
    is not tagged under a session key derived from the cluster secret."""
    _, decode = pair
    before = [[(k.clone(), v.clone()) for k, v in rank] for rank in decode.caches]
    served = []

    def fake(conn: socket.socket, rank: int) -> None:
        send_frame(conn, {"nonce": new_nonce()})
        header, _, _, _ = recv_raw(conn)
        size = len(header["block_ids"]) * sum(t[0].numel() * t.element_size() for pair in decode.caches[rank]
                                              for t in pair)
        tag = None if rank == 0 else b"\0" * TAG_BYTES  # rank 0 untagged, rank 1 a tag under no key it knows
        served.append(rank)
        answer = {"ok": True, "block_hashes": header["block_hashes"], "namespace": header["namespace"],
                  "layout": header["layout"], "payload_bytes": size, **({"mac": True} if tag else {})}
        conn.sendall(_raw_frame(answer, tag, torch.randn(size // 4).numpy().tobytes()))
        conn.recv(1)

    held = _pull_via(decode, fake, [0, 1, 2, 3], "f" * 32)
    assert sorted(served) == list(range(TP)), "the fake agent was not dialled by every rank"
    assert held.num_pulled == 0 and held.block_ids == ()
    assert decode.metric("tpserve:kv_transfer_fallbacks_total", reason="failed") == 1
    assert _decode_blocks_unchanged(decode, before)
    hashes = prompt_block_hashes(PROMPT, b"", BLOCK_SIZE, 4)
    assert decode.scheduler.allocator.lookup(hashes) == []  # no later request finds anything
    assert decode.scheduler.allocator.num_free_blocks == NUM_BLOCKS


def test_a_fake_agent_with_a_forged_tag_fails_the_check() -> None:
    """The tag covers direction, sequence, header and payload: a frame under another key, a reflected one,
    or an altered byte fails."""
    agent_nonce, caller_nonce = new_nonce(), new_nonce()
    key = session_key(SECRET, "read", agent_nonce, caller_nonce)
    agent, caller = FrameMac(key, agent=True), FrameMac(key, agent=False)
    header = {"ok": True, "block_hashes": ["00"]}
    pieces = encode_frame(header, b"kv-bytes", agent)
    body = bytes(pieces[0][4:])
    decoded = json.loads(body)
    caller.check(decoded, body, bytearray(b"kv-bytes"), bytes(pieces[2]))  # the genuine frame
    for change in ((body, b"kv-bytez", pieces[2]), (body.replace(b"00", b"01"), b"kv-bytes", pieces[2])):
        fresh = FrameMac(key, agent=False)
        with pytest.raises(WireError, match="failed its authentication"):
            fresh.check(json.loads(change[0]), change[0], bytearray(change[1]), bytes(change[2]))
    with pytest.raises(WireError, match="failed its authentication"):  # replayed: the sequence moved on
        caller.check(decoded, body, bytearray(b"kv-bytes"), bytes(pieces[2]))
    reflected = encode_frame(header, b"kv-bytes", FrameMac(key, agent=False))  # the caller's own frame back
    with pytest.raises(WireError, match="failed its authentication"):
        FrameMac(key, agent=False).check(decoded, bytes(reflected[0][4:]), bytearray(b"kv-bytes"), bytes(reflected[2]))
    other = session_key("another-secret-000000", "read", agent_nonce, caller_nonce)
    forged = encode_frame(header, b"kv-bytes", FrameMac(other, agent=True))
    with pytest.raises(WireError, match="failed its authentication"):
        FrameMac(key, agent=False).check(decoded, bytes(forged[0][4:]), bytearray(b"kv-bytes"), bytes(forged[2]))
    with pytest.raises(WireError, match="unauthenticated frame"):  # stripped of its tag
        FrameMac(key, agent=False).check(header, body, bytearray(b"kv-bytes"), None)


def test_a_relay_cannot_turn_the_decode_ranks_proof_into_its_own_commands(pair) -> None:
    """F1 (relay): an attacker's address forwards the real agent's greeting to the decode rank and takes the
    decode rank's first frame, then tries it on the real agent as a ``hold`` and as a ``read`` of another
    transfer: both refused (the tag covers the whole frame and the purpose), and no hold is made."""
    prefill, decode = pair
    kv = _hand_over(prefill)
    answers: list[dict] = []

    def relay(conn: socket.socket, rank: int) -> None:
        upstream, agent_nonce = connect("127.0.0.1", prefill.agents[rank].port, 5.0)
        with upstream:
            send_frame(conn, {"nonce": agent_nonce})
            header, _, _, tag = recv_raw(conn)
            forged = [{**header, "op": "hold", "transfer_id": "e" * 32, "block_ids": list(range(8)),
                       "block_hashes": ["00"] * 8, "timeout_s": 60},
                      {**header, "transfer_id": "e" * 32}]
            upstream.sendall(_raw_frame(forged[rank % 2], tag))
            answer, _ = recv_frame(upstream, max_payload_bytes=1 << 20)
            answers.append(answer)

    held = _pull_via(decode, relay, kv.remote_block_ids, kv.remote_request_id)
    assert len(answers) == TP and all(a["ok"] is False for a in answers)
    assert {a["error"] for a in answers} == {"hold and pull come only from this rank's own coordinator",
                                             "missing or wrong cluster secret"}
    assert held.num_pulled == 0
    assert all(agent.num_holds == 1 for agent in prefill.agents)  # the genuine hand-off's only


def test_a_relay_that_alters_the_kv_in_flight_is_caught(pair) -> None:
    """A relay that forwards the genuine exchange but flips one byte of the K/V: the decode rank refuses it."""
    prefill, decode = pair
    kv = _hand_over(prefill)
    before = [[(k.clone(), v.clone()) for k, v in rank] for rank in decode.caches]

    def relay(conn: socket.socket, rank: int) -> None:
        with socket.create_connection(("127.0.0.1", prefill.agents[rank].port)) as upstream:
            hello, body, _, _ = recv_raw(upstream)
            conn.sendall(_raw_frame(hello))
            header, body, payload, tag = recv_raw(conn)
            upstream.sendall(struct.pack(">I", len(body)) + body + payload + (tag or b""))
            header, body, payload, tag = recv_raw(upstream, max_payload_bytes=1 << 24)
            payload[len(payload) // 2] ^= 1
            conn.sendall(struct.pack(">I", len(body)) + body + bytes(payload) + (tag or b""))
            conn.recv(1)

    held = _pull_via(decode, relay, kv.remote_block_ids, kv.remote_request_id)
    assert held.num_pulled == 0 and _decode_blocks_unchanged(decode, before)
    assert decode.metric("tpserve:kv_transfer_fallbacks_total", reason="failed") == 1


@pytest.mark.parametrize("key", [SECRET, None, "guessed-control-key-0000"])
def test_hold_and_pull_come_only_from_the_ranks_own_coordinator(pair, key) -> None:
    """F1/F2: neither a peer holding the cluster secret, nor a caller with none, nor one with a guessed key
    can make a rank hold (then read) blocks, or pull."""
    prefill, _ = pair
    for op in ("hold", "pull"):
        sock, agent_nonce = connect("127.0.0.1", prefill.agents[0].port, 5.0)
        with sock:
            nonce, mac = caller_session(key, op, agent_nonce)
            send_frame(sock, {"op": op, "nonce": nonce, "transfer_id": "e" * 32, "block_ids": list(range(8)),
                              "block_hashes": ["00"] * 8, "namespace": "", "timeout_s": 60}, mac=mac)
            answer, _ = recv_frame(sock, mac=mac)
        assert answer == {"ok": False, "error": "hold and pull come only from this rank's own coordinator"}
    assert prefill.agents[0].num_holds == 0


def test_without_a_cluster_secret_no_one_but_the_coordinator_holds_and_reads_need_the_transfer_id() -> None:
    """F2: the probe's attack without a secret (``hold`` arbitrary blocks, ``read`` them) fails at the hold; a
    guessed transfer id reads nothing; the replicas' own hand-off still works."""
    prefill = make_replica("kv_producer", 1, secret=None, hold_timeout_s=5.0)
    decode = make_replica("kv_consumer", 2, secret=None, pull_timeout_s=2.0)
    try:
        sock, agent_nonce = connect("127.0.0.1", prefill.agents[0].port, 5.0)
        with sock:
            nonce, mac = caller_session(None, "hold", agent_nonce)
            send_frame(sock, {"op": "hold", "nonce": nonce, "transfer_id": "e" * 32, "block_ids": [0, 1],
                              "block_hashes": ["00", "01"], "namespace": "", "timeout_s": 60}, mac=mac)
            assert recv_frame(sock)[0]["ok"] is False
        assert prefill.agents[0].num_holds == 0
        kv = _hand_over(prefill)
        sock, agent_nonce = connect("127.0.0.1", prefill.agents[0].port, 5.0)
        with sock:
            nonce, mac = caller_session(None, "read", agent_nonce)
            send_frame(sock, {"op": "read", "nonce": nonce, "transfer_id": "0" * 32, "block_ids": kv.remote_block_ids,
                              "block_hashes": [], "namespace": "", "first_block": 0, "tp_rank": 0, "tp_size": TP})
            answer, payload = recv_frame(sock, max_payload_bytes=1 << 20)
        assert answer["ok"] is False and "no such transfer" in answer["error"] and not payload
        held = asyncio.run(decode.connector.pull(decode.scheduler, PROMPT, b"", kv))
        assert held.num_pulled == 4
    finally:
        _close(prefill, decode)


def test_without_a_cluster_secret_pulled_blocks_serve_only_the_request_that_pulled_them() -> None:
    """F1 without a secret: what a peer that proved nothing served is cached under a namespace of the request
    alone, so another request of the same prompt (another tenant's, or an innocent one) never hits it."""
    prefill = make_replica("kv_producer", 1, secret=None, hold_timeout_s=5.0)
    decode = make_replica("kv_consumer", 2, secret=None, pull_timeout_s=2.0)
    try:
        kv = _hand_over(prefill)
        held = asyncio.run(decode.connector.pull(decode.scheduler, PROMPT, b"", kv))
    finally:
        _close(prefill, decode)
    assert held.num_pulled == 4
    allocator = decode.scheduler.allocator
    assert allocator.lookup(prompt_block_hashes(PROMPT, b"", BLOCK_SIZE, 4)) == []
    private = held.namespace  # what the request runs under
    assert private and allocator.lookup(prompt_block_hashes(PROMPT, private, BLOCK_SIZE, 4)) == list(held.block_ids)


def test_with_a_cluster_secret_pulled_blocks_serve_their_namespace(pair) -> None:
    """The peer proved the secret: its blocks are the namespace's prefix cache, as before."""
    prefill, decode = pair
    held = asyncio.run(decode.connector.pull(decode.scheduler, PROMPT, b"", _hand_over(prefill)))
    assert held.num_pulled == 4 and held.namespace is None
    assert decode.scheduler.allocator.lookup(prompt_block_hashes(PROMPT, b"", BLOCK_SIZE, 4)) == list(held.block_ids)


def test_without_a_cluster_secret_a_peer_off_loopback_is_not_dialled() -> None:
    decode = make_replica("kv_consumer", 2, secret=None, pull_timeout_s=2.0)
    try:
        kv = parse_params(json.dumps({"do_remote_prefill": True, "remote_block_ids": [0, 1, 2, 3],
                                      "remote_host": "192.0.2.7", "remote_port": 5600,
                                      "remote_request_id": "f" * 32}))
        assert "remote_host 192.0.2.7 is not loopback" in decode.connector.refusal(kv)
        held = asyncio.run(decode.connector.pull(decode.scheduler, PROMPT, b"", kv))
    finally:
        _close(decode)
    assert held.block_ids == () and decode.metric("tpserve:kv_transfer_fallbacks_total", reason="refused") == 1


def test_hand_offs_hold_at_most_their_share_of_the_pool_in_all_and_per_tenant() -> None:
    """F3: 32 blocks, a quarter for every hold (8), an eighth for one tenant (4); a prompt hands 4 over."""
    prefill = make_replica("kv_producer", 1, hold_timeout_s=5.0, max_hold_fraction=0.25,
                       max_hold_fraction_per_tenant=0.125)
    try:
        connector, scheduler = prefill.connector, prefill.scheduler
        first = connector.reserve(scheduler, "tenant-a", len(PROMPT))
        with pytest.raises(ResourceExhaustedError, match="this tenant's hand-offs hold 4 of this replica's 32 KV "
                                                         "blocks.*max_hold_fraction_per_tenant") as info:
            connector.reserve(scheduler, "tenant-a", len(PROMPT))
        assert info.value.retry_pushback_ms == 1000
        connector.reserve(scheduler, "tenant-b", len(PROMPT))  # another tenant is not starved by the first
        with pytest.raises(ResourceExhaustedError, match="every tenant's hand-offs hold 8.*max_hold_fraction "):
            connector.reserve(scheduler, "", len(PROMPT))
        with pytest.raises(ResourceExhaustedError, match="this prompt's need 9") as info:  # never fits: no retry
            connector.reserve(scheduler, "tenant-c", 9 * BLOCK_SIZE + 1)
        assert info.value.retry_pushback_ms is None

        async def hold_and_expire():  # the reservation becomes the hold's and ends with it
            prefill_blocks(prefill)
            await connector.hand_over(scheduler, PROMPT, b"", hold_timeout_s=0.3, reservation=first)
            first.release()  # the request's own release as it ends: the hold owns the blocks now
            assert connector.budget.total == 8
            await until(lambda: connector.budget.total == 4)

        asyncio.run(hold_and_expire())
        connector.reserve(scheduler, "tenant-a", len(PROMPT))
    finally:
        _close(prefill)


def test_a_hold_that_ends_refreshes_the_load_gauges(pair) -> None:
    """F4: the blocks a hold frees between steps reach the usage gauge at once, not at the next request."""
    prefill, _ = pair
    refreshed: list[int] = []
    prefill.connector.on_blocks_freed = lambda: refreshed.append(prefill.scheduler.allocator.num_free_blocks)

    async def run():
        prefill_blocks(prefill)
        await prefill.connector.hand_over(prefill.scheduler, PROMPT, b"", hold_timeout_s=0.3)
        assert refreshed == []
        await until(lambda: refreshed)

    asyncio.run(run())
    assert refreshed == [NUM_BLOCKS]


def test_a_control_key_is_never_the_cluster_secret() -> None:
    """The two keys derive sessions of their own purpose: a tag for a read never passes as a hold's."""
    agent_nonce, caller_nonce = new_nonce(), new_nonce()
    assert session_key(CONTROL, "control", agent_nonce, caller_nonce) != session_key(CONTROL, "read", agent_nonce,
                                                                                     caller_nonce)
    with pytest.raises(WireError, match="32 lowercase hex"):
        session_key(SECRET, "read", agent_nonce, "")


def test_a_large_payload_is_tagged_piece_by_piece_and_checked_whole() -> None:
    """Payloads over 1 MiB are hashed as they are sent and received (kv_wire.CHUNK_BYTES): the tag is the same
    as a whole-payload one, and a byte altered in any piece fails the check."""
    agent_nonce, caller_nonce = new_nonce(), new_nonce()
    key = session_key(SECRET, "read", agent_nonce, caller_nonce)
    payload = torch.randint(0, 256, (3 * 1024 * 1024 + 5,), dtype=torch.uint8).numpy().tobytes()
    sender, receiver = FrameMac(key, agent=True), FrameMac(key, agent=False)
    left, right = socket.socketpair()
    with left, right:
        done = threading.Thread(target=send_frame, args=(left, {"ok": True}, payload, sender))
        done.start()
        header, got = recv_frame(right, max_payload_bytes=len(payload), mac=receiver)
        done.join()
        assert header["ok"] is True and bytes(got) == payload
        whole = encode_frame({"ok": True}, payload, FrameMac(key, agent=True))  # the same tag, in one pass
        altered = bytearray(payload)
        altered[2 * 1024 * 1024 + 7] ^= 1  # in the third piece
        for data, intact in ((whole[0] + bytes(altered) + bytes(whole[2]), False),
                             (whole[0] + payload + bytes(whole[2]), True)):
            sending = threading.Thread(target=left.sendall, args=(data,))  # more than the socket buffers
            sending.start()
            if intact:
                assert bytes(recv_frame(right, max_payload_bytes=len(payload), mac=FrameMac(key, agent=False))[1]) \
                    == payload
            else:
                with pytest.raises(WireError, match="failed its authentication"):
                    recv_frame(right, max_payload_bytes=len(payload), mac=FrameMac(key, agent=False))
            sending.join()
