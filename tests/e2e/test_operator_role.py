"""Issue 41 through the real gRPC server: what a tenant's key may not do, and the operator's may.

One server (the embedded model, tp 1, prefix caching on) with two tenant keys (A and B,
``--api-key-file``) and an operator key (``--operator-api-key-file``, what a gateway holds),
``--max-kv-event-subscribers 2``. A tenant key could read every tenant's prompts off the KV
event stream (fault 1), flush every tenant's prefix cache and read server-wide state (fault 2),
and jump every queue with a negative priority (fault 7); the operator still can.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tests.e2e.cluster import RunningCluster, serve
from tpserve.client import Client, Credentials

pytestmark = pytest.mark.e2e

KEY_A, KEY_B, OPERATOR = "tenant-a-key-0123456789", "tenant-b-key-9876543210", "operator-key-5555555555"
#: 75 tokens with the BOS: 4 full blocks of 16 reach the prefix cache.
SECRET_PROMPT = ("Once upon a time there was a little girl named Lily. She had a secret box. The code of the box "
                 "was 4721. Every day she opened the box and looked at her toys. One day her friend Tom came to "
                 "play. He wanted to see the box. Lily said no.")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[RunningCluster]:
    keys = tmp_path_factory.mktemp("keys")
    (keys / "tenants").write_text(f"{KEY_A}\n{KEY_B}\n")
    (keys / "operators").write_text(f"# the gateway\n{OPERATOR}\n")
    with serve(None, 1, "--api-key-file", str(keys / "tenants"), "--operator-api-key-file", str(keys / "operators"),
               "--max-kv-event-subscribers", "2", credentials=Credentials(api_key=KEY_A)) as running:
        yield running


@pytest.fixture(scope="module")
def engine(cluster: RunningCluster) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(cluster.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def _as(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def _client(cluster: RunningCluster, key: str) -> Client:
    return Client(cluster.target, credentials=Credentials(api_key=key))


def _denied(call) -> str:
    """The details of ``call``'s PERMISSION_DENIED (fails the test on success or on another code)."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__next__"):  # a stream: its first message raises
            next(result)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    assert "operator" in info.value.details()
    return info.value.details()


def _listen(engine, key: str, seen: list[list[int]]) -> grpc.Call:
    """Subscribes to the KV events with ``key``; a thread collects the stored blocks' token ids."""
    stream = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=_as(key), timeout=60)

    def run() -> None:
        try:
            for batch in stream:
                seen.extend(list(e.stored.blocks[0].token_ids) for e in batch.events if e.HasField("stored"))
        except grpc.RpcError as exc:
            seen.append([exc.code().value[0]])  # the refusal, as a marker

    threading.Thread(target=run, daemon=True).start()
    return stream


def test_a_tenant_cannot_read_other_tenants_prompts_off_the_kv_events(cluster: RunningCluster, engine) -> None:
    """Fault 1: tenant B, subscribed, received A's prompt block by block (salted or not)."""
    by_b: list[list[int]] = []
    by_operator: list[list[int]] = []
    b_stream, op_stream = _listen(engine, KEY_B, by_b), _listen(engine, OPERATOR, by_operator)
    time.sleep(0.5)  # subscribed
    with _client(cluster, KEY_A) as a:
        a.generate(SECRET_PROMPT, max_tokens=1, temperature=0, timeout_s=30, cache_salt="a-secret-salt")
        a.generate(SECRET_PROMPT + " Again.", max_tokens=1, temperature=0, timeout_s=30)
    deadline = time.monotonic() + 10
    while len(by_operator) < 8 and time.monotonic() < deadline:  # 4 blocks per request
        time.sleep(0.05)
    b_stream.cancel()
    op_stream.cancel()
    stored_by_b = [ids for ids in by_b if len(ids) == 16]
    assert stored_by_b == [], f"tenant B read {len(stored_by_b)} of A's blocks"
    assert by_b == [[grpc.StatusCode.PERMISSION_DENIED.value[0]]]
    assert len(by_operator) >= 8  # the gateway's key still gets every block
    _denied(lambda: engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=_as(KEY_A), timeout=5))


def test_a_tenant_cannot_flush_the_prefix_cache(cluster: RunningCluster, engine) -> None:
    """Fault 2: B's FlushCache dropped A's cached blocks (A's next request: 0 cached tokens)."""
    with _client(cluster, KEY_A) as a:
        a.generate(SECRET_PROMPT, max_tokens=1, temperature=0, timeout_s=30)
        _denied(lambda: engine.FlushCache(common_pb2.FlushCacheRequest(), metadata=_as(KEY_B), timeout=5))
        cached = a.generate(SECRET_PROMPT, max_tokens=1, temperature=0, timeout_s=30).usage.cached_prompt_tokens
        assert cached == 64, f"A's cached tokens after B's flush: {cached}"
        flushed = engine.FlushCache(common_pb2.FlushCacheRequest(), metadata=_as(OPERATOR), timeout=5)
        assert flushed.success, flushed.message
        assert a.generate(SECRET_PROMPT, max_tokens=1, temperature=0, timeout_s=30).usage.cached_prompt_tokens == 0


def test_server_wide_state_is_the_operators(cluster: RunningCluster, engine) -> None:
    """Fault 2: GetServerInfo showed anybody's last request time, GetLoads the global hit rate,
    GetModelInfo the server's model directory."""
    with _client(cluster, KEY_A) as a:
        a.generate(SECRET_PROMPT, max_tokens=1, temperature=0, timeout_s=30)
    engine.Generate(vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                                        sampling_params=vpb.SamplingParams(max_tokens=1)),
                    metadata=_as(KEY_A), timeout=30).next()
    tenant = engine.GetServerInfo(vpb.GetServerInfoRequest(), metadata=_as(KEY_B), timeout=5)
    operator = engine.GetServerInfo(vpb.GetServerInfoRequest(), metadata=_as(OPERATOR), timeout=5)
    assert (tenant.last_receive_timestamp, tenant.uptime_seconds) == (0, 0), tenant
    assert operator.last_receive_timestamp > 0 and operator.uptime_seconds > 0
    assert tenant.block_size == operator.block_size == 16 and tenant.server_type == operator.server_type
    _denied(lambda: engine.GetLoads(vpb.GetLoadsRequest(), metadata=_as(KEY_B), timeout=5))
    assert engine.GetLoads(vpb.GetLoadsRequest(), metadata=_as(OPERATOR), timeout=5).loads[0].max_total_num_tokens > 0
    for key in (KEY_B, OPERATOR):
        info = engine.GetModelInfo(vpb.GetModelInfoRequest(), metadata=_as(key), timeout=5)
        assert info.model_path == info.tokenizer_path == info.served_model_name == "tpserve-tiny-stories"
        assert "/" not in info.model_path


def test_only_the_operator_may_jump_the_queue(cluster: RunningCluster) -> None:
    """Fault 7: a tenant's priority -100 went ahead of every other tenant's default 0."""
    with _client(cluster, KEY_A) as a, _client(cluster, OPERATOR) as operator:
        details = _denied(lambda: a.generate(SECRET_PROMPT, max_tokens=1, priority=-1, timeout_s=30))
        assert "priority -1" in details
        assert a.generate(SECRET_PROMPT, max_tokens=1, priority=3, timeout_s=30).usage.completion_tokens == 1
        assert operator.generate(SECRET_PROMPT, max_tokens=1, priority=-1, timeout_s=30).usage.completion_tokens == 1


def test_kv_event_subscribers_are_capped(cluster: RunningCluster, engine) -> None:
    """Fault 3: nothing capped subscribers; 1,000 that never read slowed every stream."""
    streams = [engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=_as(OPERATOR), timeout=30)
               for _ in range(2)]
    time.sleep(0.5)  # both subscribed
    with pytest.raises(grpc.RpcError) as info:
        next(engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=_as(OPERATOR), timeout=5))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-kv-event-subscribers 2" in info.value.details()
    for stream in streams:
        stream.cancel()
    time.sleep(0.5)  # both unsubscribed: a place is free again
    again = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=_as(OPERATOR), timeout=30)
    with _client(cluster, OPERATOR) as operator:
        operator.generate("A big red dragon flew over the green hills and the old town every day.", max_tokens=1,
                          timeout_s=30)  # a prompt no other test sends: its first block is new
    assert next(again).sequence_number == 1
    again.cancel()
