"""gRPC's own retry policy on the client's channel (tpserve/service_config.py) and the server's
pushback (coordinator/pushback.py, coordinator/errors.py), against an in-process Generation
server whose handlers fail as scripted, behind the public port's ErrorInterceptor.

Every client here has the stream mover off (``MovePolicy(max_moves=0)``): what is retried is
retried by gRPC, not by code of ours.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import grpc
import pytest

from coordinator.errors import ErrorInterceptor, ResourceExhaustedError, UnavailableError
from coordinator.pushback import MAX_PUSHBACK_MS, MIN_PUSHBACK_MS, PUSHBACK_KEY, queue_full_pushback_ms
from tests.e2e.cluster import free_port
from tpserve.client import AsyncClient, Client
from tpserve.service_config import Keepalive, RetryPolicy, channel_options, service_config
from tpserve.stream_move import MovePolicy
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

NO_RETRIES = RetryPolicy(max_attempts=1)


class ScriptedGeneration(generate_pb2_grpc.GenerationServicer):
    """Fails the first ``failures`` attempts of each call with ``error``; records when each attempt came."""

    def __init__(self, error: Exception, failures: int, fail_after_first_message: bool = False) -> None:
        self.error, self.failures, self.fail_after_first = error, failures, fail_after_first_message
        self.attempts: list[float] = []

    def _attempt(self) -> bool:
        self.attempts.append(time.monotonic())
        return len(self.attempts) <= self.failures

    async def Generate(self, request, context):
        if self._attempt():
            raise self.error
        return pb.GenerateResponse(request_id="r", text="ok", token_ids=[7], finish_reason=pb.FINISH_REASON_LENGTH)

    async def GenerateStream(self, request, context):
        failing = self._attempt()
        if failing and not self.fail_after_first:
            raise self.error
        yield pb.GenerateStreamResponse(request_id="r", text="a", token_ids=[1])
        if failing:
            raise self.error
        yield pb.GenerateStreamResponse(request_id="r", text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH)


async def _serve(servicer: ScriptedGeneration) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _run(servicer: ScriptedGeneration, call, retry_policy: RetryPolicy = RetryPolicy()):
    async def main():
        server, target = await _serve(servicer)
        try:
            async with AsyncClient(target, move_policy=MovePolicy(max_moves=0), retry_policy=retry_policy) as client:
                # Connected first: a call racing the first connect can end UNAVAILABLE from the transport
                # (seen once in CI with NO_RETRIES), which is not the server's answer these tests read.
                await asyncio.wait_for(client.channel.channel_ready(), 10)
                return await call(client)
        finally:
            await server.stop(None)

    return asyncio.run(main())


async def _generate(client: AsyncClient):
    return await client.generate([1, 2, 3], max_tokens=1, timeout_s=20)


async def _stream(client: AsyncClient) -> list[str]:
    texts = []
    async for chunk in client.generate_stream([1, 2, 3], max_tokens=2, timeout_s=20):
        texts.append(chunk.text)
    return texts


def test_unavailable_unary_call_is_retried_by_grpc_and_fails_without_the_policy() -> None:
    servicer = ScriptedGeneration(UnavailableError("replica restarting"), failures=2)
    assert _run(servicer, _generate).text == "ok"
    assert len(servicer.attempts) == 3

    servicer = ScriptedGeneration(UnavailableError("replica restarting"), failures=2)
    with pytest.raises(grpc.RpcError) as err:
        _run(servicer, _generate, NO_RETRIES)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(servicer.attempts) == 1


def test_retries_stop_at_max_attempts() -> None:
    servicer = ScriptedGeneration(UnavailableError("down"), failures=10)
    with pytest.raises(grpc.RpcError) as err:
        _run(servicer, _generate, RetryPolicy(max_attempts=3, initial_backoff_s=0.01))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(servicer.attempts) == 3


def test_stream_is_retried_before_its_first_message_only() -> None:
    servicer = ScriptedGeneration(UnavailableError("replica restarting"), failures=1)
    assert _run(servicer, _stream) == ["a", "b"]
    assert len(servicer.attempts) == 2

    # After a message arrived the call is committed: gRPC does not retry it (the stream mover's case).
    servicer = ScriptedGeneration(UnavailableError("replica lost"), failures=1, fail_after_first_message=True)
    with pytest.raises(grpc.RpcError) as err:
        _run(servicer, _stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(servicer.attempts) == 1


def test_full_queue_sends_pushback_and_the_client_waits_for_it() -> None:
    servicer = ScriptedGeneration(ResourceExhaustedError("the queue is full (1 requests waiting)", 600), failures=1)

    async def raw_call(client: AsyncClient):  # the trailer as it comes, no retry
        call = client.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])), timeout=20)
        with pytest.raises(grpc.RpcError) as err:
            await call
        return err.value.code(), dict(await call.trailing_metadata())

    code, trailer = _run(servicer, raw_call, NO_RETRIES)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailer[PUSHBACK_KEY] == "600"

    # The policy's own backoff before attempt 2 is about 25 ms: a 0.6 s gap is the server's pushback.
    servicer = ScriptedGeneration(ResourceExhaustedError("the queue is full (1 requests waiting)", 600), failures=1)
    assert _run(servicer, _generate).text == "ok"
    assert len(servicer.attempts) == 2
    assert 0.55 <= servicer.attempts[1] - servicer.attempts[0] < 3.0


def test_resource_exhausted_that_no_retry_cures_says_do_not_retry() -> None:
    servicer = ScriptedGeneration(ResourceExhaustedError("the request needs up to 9000 tokens of KV cache"),
                                  failures=5)
    with pytest.raises(grpc.RpcError) as err:
        _run(servicer, _generate)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata())[PUSHBACK_KEY] == "-1"
    assert len(servicer.attempts) == 1  # gRPC honours the negative pushback


class _Seq:
    def __init__(self, arrival_s: float | None) -> None:
        self.arrival_s = arrival_s


def test_queue_full_pushback_is_the_oldest_wait_bounded() -> None:
    assert queue_full_pushback_ms([_Seq(100.0), _Seq(101.5), _Seq(None)], now=102.25) == 2250
    assert queue_full_pushback_ms([_Seq(102.2)], now=102.25) == MIN_PUSHBACK_MS
    assert queue_full_pushback_ms([], now=5.0) == MIN_PUSHBACK_MS  # every place held, none queued yet
    assert queue_full_pushback_ms([_Seq(0.0)], now=3600.0) == MAX_PUSHBACK_MS


def test_service_config_shape() -> None:
    config = service_config("pick_first", RetryPolicy())
    assert config["loadBalancingConfig"] == [{"pick_first": {}}]
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": "tpserve.v1.Generation"}]
    assert method["retryPolicy"] == {"maxAttempts": 5, "initialBackoff": "0.025s", "maxBackoff": "0.25s",
                                     "backoffMultiplier": 2.0,
                                     "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}
    assert config["retryThrottling"] == {"maxTokens": 10, "tokenRatio": 0.1}
    assert "methodConfig" not in service_config("round_robin", NO_RETRIES)
    options = dict(channel_options())
    assert options["grpc.enable_retries"] == 1
    assert json.loads(options["grpc.service_config"])["loadBalancingConfig"] == [{"round_robin": {}}]
    with pytest.raises(ValueError, match="max_attempts"):
        service_config("round_robin", RetryPolicy(max_attempts=0))


def test_retry_throttling_stops_retrying_a_target_that_keeps_failing() -> None:
    """retryThrottling (10 tokens, one per failed attempt, retries only above 5): the first call makes its
    5 attempts, after which the channel has 5 tokens left and the second call gets one attempt, no retry."""
    servicer = ScriptedGeneration(UnavailableError("down"), failures=100)

    async def two_calls(client: AsyncClient) -> list[int]:
        per_call = []
        for _ in range(2):
            before = len(servicer.attempts)
            with pytest.raises(grpc.RpcError):
                await _generate(client)
            per_call.append(len(servicer.attempts) - before)
        return per_call

    assert _run(servicer, two_calls) == [5, 1]


def test_channels_ping_a_silent_server() -> None:
    """Keepalive (tpserve/service_config.py): a ping after 10 s without a frame, 10 s for any ping's answer
    (the BDP ping a call's data sends included), pings with no call open and with no data sent."""
    options = dict(channel_options())
    assert options["grpc.keepalive_time_ms"] == 10_000
    assert options["grpc.keepalive_timeout_ms"] == 10_000
    assert options["grpc.http2.ping_timeout_ms"] == 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 0
    fast = dict(channel_options("pick_first", NO_RETRIES, Keepalive(time_s=1.5, timeout_s=0.25)))
    assert (fast["grpc.keepalive_time_ms"], fast["grpc.keepalive_timeout_ms"], fast["grpc.http2.ping_timeout_ms"]) \
        == (1500, 250, 250)
    assert not any("keepalive" in name or "ping" in name
                   for name, _ in channel_options(keepalive=Keepalive(enabled=False)))
    with pytest.raises(ValueError, match="at least 1 s"):
        channel_options(keepalive=Keepalive(time_s=0.5))
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        channel_options(keepalive=Keepalive(timeout_s=0))


@pytest.mark.parametrize("field, value", [
    ("max_attempts", 0), ("max_attempts", 2.5), ("initial_backoff_s", -1), ("initial_backoff_s", 0.0005),
    ("max_backoff_s", 0), ("max_backoff_s", 0.01), ("backoff_multiplier", 0), ("backoff_multiplier", math.inf),
    ("retryable_status_codes", ("BOGUS",)), ("retryable_status_codes", ()), ("retryable_status_codes", "UNAVAILABLE"),
    ("throttle_max_tokens", 0), ("throttle_max_tokens", 2**32), ("throttle_token_ratio", 0),
    ("throttle_token_ratio", 0.0005),
])
def test_a_retry_policy_grpc_would_refuse_is_refused_when_made_naming_the_field(field: str, value: object) -> None:
    """gRPC took these and failed every call of the channel with INVALID_ARGUMENT ("errors validating service
    config"), which read as the server refusing the request."""
    with pytest.raises(ValueError, match=rf"^RetryPolicy\.{field} must be "):
        RetryPolicy(**{field: value})


def test_an_unknown_load_balancing_policy_is_refused_when_the_client_is_made() -> None:
    with pytest.raises(ValueError, match="load_balancing_policy must be one of round_robin, pick_first, got 'weird'"):
        Client("127.0.0.1:1", load_balancing_policy="weird")  # type: ignore[arg-type]


def test_the_edges_of_the_retry_policy_ranges_are_what_grpc_takes() -> None:
    """The least (and largest) values RetryPolicy takes make a channel gRPC accepts: its call fails for want
    of a server (UNAVAILABLE, or its deadline while gRPC waits to reconnect), not with INVALID_ARGUMENT from the
    service config parser."""
    edges = RetryPolicy(initial_backoff_s=0.001, max_backoff_s=0.001, backoff_multiplier=1e-9,
                        retryable_status_codes=("UNAVAILABLE",), throttle_max_tokens=2**32 - 1,
                        throttle_token_ratio=0.001)
    with Client(f"127.0.0.1:{free_port()}", retry_policy=edges, move_policy=MovePolicy(max_moves=0)) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate([1], max_tokens=1, timeout_s=2)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), err.value.details()
