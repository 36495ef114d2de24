"""The KV transfer in one process: two "replicas" of two ranks each (tests/worker/kv_replicas.py), every rank a
real KVAgent over loopback TCP with its own cache tensors, driven by the real coordinator KVConnector."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
import torch

from coordinator.cache_isolation import prefix_cache_namespace
from coordinator.kv_cache_manager import prompt_block_hashes
from coordinator.kv_transfer.params import parse_params
from tests.worker.kv_replicas import (BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS, PROMPT, SECRET, TP, Replica, float_caches,
                                      eight_bit_caches, make_replica, prefill_blocks, until)
from tpserve.kv_wire import caller_session, connect, recv_frame, send_frame
from worker.kv_transfer.agent import KVAgent
from worker.kv_transfer.transport import TcpTransport, make_transport


@pytest.fixture
def pair() -> Iterator[tuple[Replica, Replica]]:
    prefill = make_replica("kv_producer", 1, hold_timeout_s=2.0)
    decode = make_replica("kv_consumer", 2, pull_timeout_s=2.0)
    yield prefill, decode
    for agent in prefill.agents + decode.agents:
        agent.close()


def test_each_decode_rank_gets_its_prefill_ranks_blocks_and_the_prefill_frees_them(pair) -> None:
    prefill, decode = pair

    async def run():
        blocks = prefill_blocks(prefill)
        kv = parse_params(await prefill.connector.hand_over(prefill.scheduler, PROMPT, b""))
        assert kv.remote_block_ids == blocks and kv.tp_size == TP and kv.block_size == BLOCK_SIZE
        assert all(prefill.scheduler.allocator.ref_count(b) == 1 for b in blocks)  # held for the pull
        held = await decode.connector.pull(decode.scheduler, PROMPT, b"", kv)
        await until(lambda: prefill.metric("tpserve:kv_transfer_holds") == 0)
        return blocks, kv, held

    blocks, kv, held = asyncio.run(run())
    assert held.num_pulled == 4 and len(held.block_ids) == 4
    for rank in range(TP):  # rank i's slice came from rank i, every layer, both tensors
        for (pk, pv), (dk, dv) in zip(prefill.caches[rank], decode.caches[rank]):
            assert torch.equal(dk[list(held.block_ids)], pk[blocks]) and torch.equal(dv[list(held.block_ids)], pv[blocks])
    # The pulled blocks are the decode replica's prefix cache now, under its own hashes.
    hashes = prompt_block_hashes(PROMPT, b"", BLOCK_SIZE, 4)
    assert decode.scheduler.allocator.lookup(hashes) == list(held.block_ids)
    held.release(decode.scheduler)
    assert decode.scheduler.allocator.num_free_blocks == NUM_BLOCKS
    assert prefill.scheduler.allocator.num_free_blocks == NUM_BLOCKS
    bytes_per_rank = 4 * NUM_LAYERS * 2 * BLOCK_SIZE * 8 * 4
    assert decode.metric("tpserve:kv_transfer_bytes_total", direction="received", transport="tcp") == TP * bytes_per_rank
    assert prefill.metric("tpserve:kv_transfer_bytes_total", direction="sent", transport="tcp") == TP * bytes_per_rank
    assert prefill.metric("tpserve:kv_transfer_blocks_total", direction="sent", transport="tcp") == 4
    assert decode.metric("tpserve:kv_transfer_seconds_count", transport="tcp") == 1
    assert kv.remote_block_ids == blocks


@pytest.mark.parametrize("decode_codec", ["int8:k_offset=00aa", "int8:k_offset=00ab"])
def test_an_8_bit_cache_moves_with_its_scale_pools_between_replicas_of_one_codec(decode_codec: str) -> None:
    """Codes and their per-token scale pools move block for block; a decode replica whose codes mean something
    else (another storage type or key offset: ModelRunner.kv_codec) refuses them before a byte is written."""
    prefill = make_replica("kv_producer", 1, codec="int8:k_offset=00aa", hold_timeout_s=30.0)
    decode = make_replica("kv_consumer", 2, codec=decode_codec, pull_timeout_s=2.0)
    before = [[(k.clone(), v.clone()) for k, v in rank] for rank in decode.caches]
    try:
        async def run():
            blocks = prefill_blocks(prefill)
            kv = parse_params(await prefill.connector.hand_over(prefill.scheduler, PROMPT, b""))
            held = await decode.connector.pull(decode.scheduler, PROMPT, b"", kv)
            # Read or refused, the hold ends now (not after its 30 s) and the prefill's coordinator frees it.
            await until(lambda: prefill.scheduler.allocator.num_free_blocks == NUM_BLOCKS, timeout_s=3.0)
            return blocks, held

        blocks, held = asyncio.run(run())
    finally:
        for agent in prefill.agents + decode.agents:
            agent.close()
    if decode_codec != "int8:k_offset=00aa":
        assert held.num_pulled == 0 and decode.metric("tpserve:kv_transfer_fallbacks_total", reason="failed") == 1
        for rank in range(TP):
            for (k, v), (k0, v0) in zip(decode.caches[rank], before[rank]):
                assert torch.equal(k, k0) and torch.equal(v, v0)  # nothing written
        assert prefill.metric("tpserve:kv_transfer_holds") == 0  # the refused hold's own request: ended at once
        return
    assert held.num_pulled == 4
    for rank in range(TP):  # codes and scale pools alike: block i of each tensor
        for (pk, pv), (dk, dv) in zip(prefill.caches[rank], decode.caches[rank]):
            assert torch.equal(dk[list(held.block_ids)], pk[blocks]) and torch.equal(dv[list(held.block_ids)], pv[blocks])
    per_block = NUM_LAYERS * 2 * (BLOCK_SIZE * 2 * 8 + 2 * BLOCK_SIZE * 2)  # codes (1 byte) + bfloat16 scales
    assert decode.metric("tpserve:kv_transfer_bytes_total", direction="received", transport="tcp") == TP * 4 * per_block


def test_another_namespace_is_refused_before_a_byte_moves(pair) -> None:
    prefill, decode = pair
    tenant_a, tenant_b = prefix_cache_namespace("a", ""), prefix_cache_namespace("b", "")
    before = [[(k.clone(), v.clone()) for k, v in rank] for rank in decode.caches]

    async def run():
        prefill_blocks(prefill, tenant_a)
        kv = parse_params(await prefill.connector.hand_over(prefill.scheduler, PROMPT, tenant_a))
        return await decode.connector.pull(decode.scheduler, PROMPT, tenant_b, kv)

    held = asyncio.run(run())
    assert held.num_pulled == 0 and held.block_ids == ()
    assert decode.metric("tpserve:kv_transfer_fallbacks_total", reason="failed") == 1
    assert decode.scheduler.allocator.num_free_blocks == NUM_BLOCKS  # the blocks allocated for it are free again
    for rank in range(TP):
        for (k, v), (k0, v0) in zip(decode.caches[rank], before[rank]):
            assert torch.equal(k, k0) and torch.equal(v, v0)  # nothing written
    assert prefill.metric("tpserve:kv_transfer_holds") == 1  # still there for its own tenant


def test_an_unread_hold_ends_at_its_timeout_and_frees_the_blocks(pair) -> None:
    prefill, _ = pair

    async def run():
        prefill_blocks(prefill)
        await prefill.connector.hand_over(prefill.scheduler, PROMPT, b"")
        assert prefill.scheduler.allocator.num_free_blocks == NUM_BLOCKS - 4
        assert all(agent.num_holds == 1 for agent in prefill.agents)
        await asyncio.sleep(2.6)  # hold_timeout_s 2
        return prefill.scheduler.allocator.num_free_blocks

    assert asyncio.run(run()) == NUM_BLOCKS
    assert all(agent.num_holds == 0 for agent in prefill.agents)
    assert prefill.metric("tpserve:kv_transfer_holds") == 0


def test_a_decode_replica_with_every_block_cached_pulls_none_and_frees_the_hold(pair) -> None:
    prefill, decode = pair

    async def run():
        prefill_blocks(prefill)
        prefill_blocks(decode)
        kv = parse_params(await prefill.connector.hand_over(prefill.scheduler, PROMPT, b""))
        held = await decode.connector.pull(decode.scheduler, PROMPT, b"", kv)
        await until(lambda: prefill.scheduler.allocator.num_free_blocks == NUM_BLOCKS)
        return held

    held = asyncio.run(run())
    assert held.num_pulled == 0 and len(held.block_ids) == 4
    assert decode.metric("tpserve:kv_transfer_bytes_total", direction="received", transport="tcp") == 0


def test_another_degree_is_refused_with_one_line_and_no_connection(pair) -> None:
    _, decode = pair
    kv = parse_params('{"do_remote_prefill": true, "remote_block_ids": [0], "remote_host": "127.0.0.1", '
                      '"remote_port": 9, "remote_request_id": "x", "tp_size": 4}')
    assert decode.connector.refusal(kv) == ("the prefill replica's tensor-parallel degree 4 is not this replica's 2: "
                                            "equal degrees are required")
    held = asyncio.run(decode.connector.pull(decode.scheduler, PROMPT, b"", kv))
    assert held.block_ids == () and decode.metric("tpserve:kv_transfer_fallbacks_total", reason="refused") == 1


def test_a_read_for_another_rank_or_layout_is_refused_by_the_sender(pair) -> None:
    prefill, _ = pair

    async def hold():
        prefill_blocks(prefill)
        return parse_params(await prefill.connector.hand_over(prefill.scheduler, PROMPT, b""))

    kv = asyncio.run(hold())
    hashes = [h.hex() for h in prompt_block_hashes(PROMPT, b"", BLOCK_SIZE, 4)]
    read = {"op": "read", "transfer_id": kv.remote_request_id, "block_hashes": hashes, "namespace": "",
            "first_block": 0, "block_ids": kv.remote_block_ids, "tp_rank": 1, "tp_size": TP,
            "layout": "2x[4, 1, 8];[4, 1, 8]:float32"}
    for change, why in (({"tp_rank": 1}, "tensor-parallel rank 1 of 2 cannot read rank 0 of 2"),
                        ({"tp_rank": 0, "layout": "2x[4, 2, 8];[4, 2, 8]:float32"}, "cache layout"),
                        ({"tp_rank": 0, "block_hashes": hashes[::-1]}, "block hashes"),
                        ({"tp_rank": 0, "block_ids": kv.remote_block_ids[::-1]}, "block ids"),
                        ({"tp_rank": 0, "transfer_id": "guessed"}, "no such transfer")):
        sock, agent_nonce = connect("127.0.0.1", kv.remote_port, 5.0)
        with sock:
            nonce, mac = caller_session(SECRET, "read", agent_nonce)
            send_frame(sock, {**read, **change, "nonce": nonce}, mac=mac)
            answer, payload = recv_frame(sock, max_payload_bytes=1 << 20, mac=mac)
        assert answer["ok"] is False and why in answer["error"] and not payload


def test_a_wrong_secret_is_refused_before_the_op_is_read(pair) -> None:
    prefill, _ = pair
    sock, agent_nonce = connect("127.0.0.1", prefill.agents[0].port, 5.0)
    with sock:
        nonce, mac = caller_session("another-secret-000000", "read", agent_nonce)
        send_frame(sock, {"op": "read", "nonce": nonce, "transfer_id": "t", "block_ids": [0], "block_hashes": ["00"],
                          "namespace": "", "first_block": 0}, mac=mac)
        answer, _ = recv_frame(sock, mac=mac)
    assert answer == {"ok": False, "error": "missing or wrong cluster secret"}


def test_nixl_is_refused_with_one_line_without_the_package() -> None:
    with pytest.raises(ValueError, match="^transport nixl needs the nixl package, which is not installed"):
        make_transport("nixl", 0, 1, None, find_spec=lambda _: None)
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        make_transport("rdma", 0, 1, None)


def test_an_agent_refuses_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        agent = KVAgent("127.0.0.1", taken.getsockname()[1], 0, 1, None, list, TcpTransport(0, 1, None))
        with pytest.raises(OSError):
            agent.start()


def test_a_layout_mismatch_is_said_in_words() -> None:
    from worker.kv_transfer.blocks import layout_mismatch, layout_signature

    floats, codes = float_caches(1), eight_bit_caches(1)
    int8 = layout_signature(codes, "int8:k_offset=00aa")
    assert layout_mismatch(layout_signature(floats), int8) == (
        "the reading (decode) replica's KV cache stores float32, this (prefill) replica's int8: both replicas need "
        "the same --kv-cache-dtype")
    assert layout_mismatch(int8.replace("int8:k_offset", "float8_e4m3fn:k_offset"), int8).startswith(
        "the reading (decode) replica's KV cache stores float8_e4m3fn, this (prefill) replica's int8")
    assert layout_mismatch(layout_signature(codes, "int8:k_offset=00ab"), int8) == (
        "the replicas' 8-bit caches were calibrated differently (k_offset=00ab against k_offset=00aa: another "
        "model or hardware computed other key offsets)")
    assert layout_mismatch(layout_signature(float_caches(1, heads=2)), layout_signature(floats)).startswith(
        "cache layout 2x[4, 2, 8];[4, 2, 8]:float32 is not this rank's 2x[4, 1, 8]")
