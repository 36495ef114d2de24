"""KV transfers that must not happen, or cannot: the decode replica prefills locally and the request
completes with the tokens of one replica alone.

Two tp-1 replicas of stories260k with API keys (each key a tenant) and one cluster secret (so a
tenant has the same namespace on both, and the side channel needs the secret), driven by the
engine protocol directly, as ``smg --pd-disaggregation`` drives them (tests/e2e/test_pd_disaggregation.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from coordinator.tokenizer import Tokenizer
from tests.e2e.cluster import RunningCluster, free_port
from tests.e2e.pd import LONG_PROMPT, computed_prompt_tokens, engine_generate, labelled, serve_role, used_tokens
from tests.paths import STORIES_DIR, requires_stories
from tpserve.kv_wire import WireError, caller_session, connect, recv_frame, recv_raw, send_frame

pytestmark = [pytest.mark.e2e, requires_stories]

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
OPERATOR_KEY = "operator-key-0123456789"
SECRET = "a-cluster-secret-of-enough-length"
BLOCK_SIZE = 16
HOLD_TIMEOUT_S = 3.0


@dataclass
class Pair:
    prefill: RunningCluster
    decode: RunningCluster
    tokenizer: Tokenizer

    def prompt(self, first_word: str) -> list[int]:
        """A long prompt whose first block no other test's prompt shares (no prefix-cache hit between tests)."""
        return self.tokenizer.encode(f"{first_word}. {LONG_PROMPT}")

    def generate(self, replica: RunningCluster, key: str, prompt: list[int], kv: dict | None = None,
                 max_tokens: int = 16, **sampling) -> vpb.GenerateComplete:
        """One unstreamed engine-protocol Generate as the tenant of ``key``."""
        return engine_generate(replica, prompt, kv, max_tokens, key, **sampling)

    def hand_over(self, key: str, prompt: list[int]) -> dict:
        """The prefill replica's kv_transfer_params for ``prompt``, as the gateway asks for them."""
        out = self.generate(self.prefill, key, prompt, {"do_remote_decode": True, "do_remote_prefill": False},
                            max_tokens=1, ignore_eos=True)
        return json.loads(out.kv_transfer_params_json)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("pd-faults")
    (tmp / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    (tmp / "secret").write_text(SECRET)
    flags = ("--api-key-file", str(tmp / "keys"), "--operator-api-key", OPERATOR_KEY,
             "--cluster-secret-file", str(tmp / "secret"))
    with ExitStack() as stack:
        prefill = stack.enter_context(serve_role(STORIES_DIR, 1, "kv_producer", "p", tmp / "prefill.log", *flags,
                                                 hold_timeout_s=HOLD_TIMEOUT_S))
        decode = stack.enter_context(serve_role(STORIES_DIR, 1, "kv_consumer", "d", tmp / "decode.log", *flags,
                                                pull_timeout_s=2.0))
        yield Pair(prefill, decode, Tokenizer.from_pretrained(STORIES_DIR))


def test_the_hand_over_names_the_prompts_full_blocks(pair: Pair) -> None:
    prompt = pair.prompt("Hello")
    kv = pair.hand_over(KEY_A, prompt)
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert (kv["remote_engine_id"], kv["remote_host"], kv["tp_size"], kv["block_size"]) == ("p", "127.0.0.1", 1, 16)
    assert len(kv["remote_block_ids"]) == (len(prompt) - 1) // BLOCK_SIZE
    assert len(kv["remote_request_id"]) == 32  # 128 random bits


def test_a_block_is_never_pulled_into_another_tenants_namespace(pair: Pair) -> None:
    prompt = pair.prompt("Tenants")
    alone = pair.generate(pair.prefill, KEY_B, prompt)  # tenant B on one replica alone: the reference
    kv = pair.hand_over(KEY_A, prompt)
    failed, computed = labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed"), \
        computed_prompt_tokens(pair.decode)
    as_b = pair.generate(pair.decode, KEY_B, prompt, kv)  # B presents A's hand-over
    assert list(as_b.output_ids) == list(alone.output_ids)
    assert labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed") == failed + 1
    # Refused by the prefill's rank before a byte left: B computed its whole prompt itself.
    assert as_b.cached_tokens == 0
    assert computed_prompt_tokens(pair.decode) - computed == len(prompt)
    received = labelled(pair.decode, "tpserve:kv_transfer_blocks_total", direction="received", transport="tcp")
    as_a = pair.generate(pair.decode, KEY_A, prompt, kv)  # the hold is still there for its own tenant
    assert list(as_a.output_ids) == list(alone.output_ids)  # the same model and prompt: the same tokens
    assert as_a.cached_tokens == len(kv["remote_block_ids"]) * BLOCK_SIZE
    assert labelled(pair.decode, "tpserve:kv_transfer_blocks_total", direction="received", transport="tcp") \
        == received + len(kv["remote_block_ids"])


def test_a_transfer_that_cannot_connect_falls_back_to_a_local_prefill(pair: Pair) -> None:
    prompt = pair.prompt("Unreachable")
    alone = pair.generate(pair.prefill, KEY_A, prompt, max_tokens=20, temperature=0.9, seed=5)
    kv = {**pair.hand_over(KEY_A, prompt), "remote_port": free_port()}  # nobody listens there
    before = labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed")
    out = pair.generate(pair.decode, KEY_A, prompt, kv, max_tokens=20, temperature=0.9, seed=5)
    assert list(out.output_ids) == list(alone.output_ids)
    assert out.cached_tokens == 0
    assert labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed") == before + 1
    assert used_tokens(pair.decode, OPERATOR_KEY) == 0  # the blocks allocated for the pull were freed


def test_another_tensor_parallel_degree_is_refused_with_one_line(pair: Pair) -> None:
    prompt = pair.prompt("Degrees")
    alone = pair.generate(pair.prefill, KEY_A, prompt)
    before = labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="refused")
    out = pair.generate(pair.decode, KEY_A, prompt, {**pair.hand_over(KEY_A, prompt), "tp_size": 2})
    assert list(out.output_ids) == list(alone.output_ids)
    assert labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="refused") == before + 1


def test_an_unread_hold_is_freed_after_its_timeout(pair: Pair) -> None:
    pair.hand_over(KEY_B, pair.prompt("Timeout"))
    assert labelled(pair.prefill, "tpserve:kv_transfer_holds") >= 1
    deadline = time.monotonic() + HOLD_TIMEOUT_S + 8
    while labelled(pair.prefill, "tpserve:kv_transfer_holds") or used_tokens(pair.prefill, OPERATOR_KEY):
        assert time.monotonic() < deadline, "a hold outlived its timeout"
        time.sleep(0.1)


@pytest.mark.parametrize(("kv", "named"), [
    ("not json", "kv_transfer_params_json is not JSON"),
    ('{"do_remote_prefill": true, "remote_block_ids": ["x"]}', "remote_block_ids"),
    ('{"do_remote_prefill": true, "do_remote_decode": true}', "cannot both be true"),
    ('{"do_remote_prefill": true, "remote_block_ids": [1], "remote_host": "h", "remote_port": 0}', "remote_port"),
    ('{"do_remote_decode": "yes"}', "do_remote_decode must be a JSON bool"),
])
def test_bad_kv_transfer_params_are_invalid_argument(pair: Pair, kv: str, named: str) -> None:
    request = vpb.GenerateRequest(request_id="bad", tokenized=vpb.TokenizedInput(input_ids=pair.prompt("Bad")),
                                  sampling_params=vpb.SamplingParams(max_tokens=2), kv_transfer_params_json=kv)
    with grpc.insecure_channel(pair.decode.target) as channel, pytest.raises(grpc.RpcError) as info:
        list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            request, timeout=30, metadata=[("authorization", f"Bearer {KEY_A}")]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in info.value.details()


def test_the_side_channel_refuses_a_caller_without_the_cluster_secret(pair: Pair) -> None:
    kv = pair.hand_over(KEY_A, pair.prompt("Secret"))
    sock, agent_nonce = connect("127.0.0.1", kv["remote_port"], 5.0)
    with sock:
        nonce, mac = caller_session("not-the-secret-at-all", "read", agent_nonce)
        send_frame(sock, {"op": "read", "nonce": nonce, "transfer_id": kv["remote_request_id"]}, mac=mac)
        answer, payload = recv_frame(sock, mac=mac)
        assert answer == {"ok": False, "error": "missing or wrong cluster secret"} and not payload
        with pytest.raises(WireError):  # and hung up
            recv_frame(sock)


def test_a_prefill_replica_that_never_answers_times_out_into_a_local_prefill(pair: Pair) -> None:
    """A side channel that accepts and then says nothing: the pull gives up after pull_timeout_s (2 s)."""
    import socket

    prompt = pair.prompt("Silent")
    alone = pair.generate(pair.prefill, KEY_A, prompt)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        kv = {**pair.hand_over(KEY_A, prompt), "remote_port": silent.getsockname()[1]}
        before = labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed")
        started = time.monotonic()
        out = pair.generate(pair.decode, KEY_A, prompt, kv)
        waited = time.monotonic() - started
    assert list(out.output_ids) == list(alone.output_ids) and out.cached_tokens == 0
    assert labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed") == before + 1
    assert 2.0 <= waited < 8.0  # the pull's timeout, then the local prefill
    assert used_tokens(pair.decode, OPERATOR_KEY) == 0


def test_a_fake_prefill_agent_cannot_poison_the_decode_replicas_prefix_cache(pair: Pair) -> None:
    """F1: a caller of the decode replica names its own address as the prefill's side channel and answers the
    read with K/V of its own (echoing what was asked, as repro/kv_side_channel_attack.py did). The answer is
    not authenticated under the cluster secret: nothing is cached, the request prefills itself, and a later,
    innocent request of the same prompt gets the tokens of one replica alone."""
    import socket
    import threading

    prompt = pair.prompt("Poison")
    alone = pair.generate(pair.prefill, KEY_A, prompt)
    dialled = []

    def fake(server: socket.socket) -> None:
        conn, _ = server.accept()
        with conn:
            send_frame(conn, {"nonce": "0" * 32})
            header, _, _, _ = recv_raw(conn)
            dialled.append(header["op"])
            send_frame(conn, {"ok": True, "block_hashes": header["block_hashes"], "namespace": header["namespace"],
                              "layout": header["layout"]}, b"\x7f" * (len(header["block_ids"]) * _block_bytes(header["layout"])))
            conn.recv(1)

    with socket.create_server(("127.0.0.1", 0)) as server:
        thread = threading.Thread(target=fake, args=(server,), daemon=True)
        thread.start()
        kv = {"do_remote_prefill": True, "remote_block_ids": list(range((len(prompt) - 1) // BLOCK_SIZE)),
              "remote_host": "127.0.0.1", "remote_port": server.getsockname()[1], "remote_request_id": "f" * 32,
              "tp_size": 1, "block_size": BLOCK_SIZE}
        before = labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed")
        attacked = pair.generate(pair.decode, KEY_A, prompt, kv)
        thread.join(10)
    assert dialled == ["read"]
    assert labelled(pair.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed") == before + 1
    assert attacked.cached_tokens == 0 and list(attacked.output_ids) == list(alone.output_ids)
    innocent = pair.generate(pair.decode, KEY_A, prompt)
    assert list(innocent.output_ids) == list(alone.output_ids)


def _block_bytes(layout: str) -> int:
    """Bytes of one block of a float cache's layout signature (worker/kv_transfer/blocks.py), e.g.
    ``5x[16, 4, 8];[16, 4, 8]:float32``: what a payload of the right size takes."""
    total = 0
    for run in layout.split("|")[0].split("+"):
        count, _, rest = run.partition("x")
        shapes, _, dtype = rest.rpartition(":")
        for shape in shapes.split(";"):
            elements = 1
            for dim in json.loads(shape):
                elements *= dim
            total += int(count) * elements * {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return total
