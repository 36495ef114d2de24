"""gRPC's conventions on a live ``tpserve serve`` (docs/design/request-path.md, "gRPC conventions"): reflection v1 as
grpcurl, Postman and
evans ask for it; a replica killed under a call that gRPC's retry policy (tpserve/service_config.py)
moves to another; a full queue's RESOURCE_EXHAUSTED with server pushback (coordinator/pushback.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import grpc
import pytest
from google.protobuf import descriptor_pb2

from coordinator.pushback import MAX_PUSHBACK_MS, MIN_PUSHBACK_MS, PUSHBACK_KEY
from tests.e2e.cluster import RunningCluster, serve
from tpserve.client import Client, build_request
from tpserve.reflection_v1 import reflection_pb2 as v1_pb2
from tpserve.reflection_v1 import reflection_pb2_grpc as v1_pb2_grpc
from tpserve.service_config import RetryPolicy
from tpserve.stream_move import MovePolicy
from tpserve.v1 import generate_pb2_grpc

pytestmark = pytest.mark.e2e

SERVICES = {"tpserve.v1.Generation", "vllm.grpc.engine.VllmEngine", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
#: A unary call long enough to kill its replica under it: the embedded model's 512 positions, nearly all.
LONG = dict(max_tokens=480, ignore_eos=True, temperature=0.0)


def test_reflection_v1_lists_the_services_and_gives_their_files(default_tp2: RunningCluster) -> None:
    with grpc.insecure_channel(default_tp2.target) as channel:
        listed, by_symbol = v1_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([
            v1_pb2.ServerReflectionRequest(list_services=""),
            v1_pb2.ServerReflectionRequest(file_containing_symbol="tpserve.v1.Generation.GenerateStream"),
        ]), timeout=30)
    assert {s.name for s in listed.list_services_response.service} == SERVICES
    files = {}
    for raw in by_symbol.file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
        files[proto.name] = proto
    generate = files["tpserve/v1/generate.proto"]
    assert generate.package == "tpserve.v1"
    (service,) = [s for s in generate.service if s.name == "Generation"]
    methods = {m.name: m for m in service.method}
    assert methods["GenerateStream"].server_streaming and methods["GenerateStream"].output_type == \
        ".tpserve.v1.GenerateStreamResponse"


def _kill_under_a_call(client: Client, first: RunningCluster):
    """Sends a long unary call (pick_first: to ``first``), SIGKILLs ``first``'s process group once the
    call runs there, and returns the call's outcome: its result, or its RpcError."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: client.generate([5, 6, 7], timeout_s=120, **LONG))
        deadline = time.monotonic() + 60
        while first.metric("tpserve:num_requests_running") < 1:
            assert time.monotonic() < deadline and not future.done(), "the call never ran on the first replica"
            time.sleep(0.01)
        os.killpg(first.process.pid, signal.SIGKILL)
        try:
            return future.result()
        except grpc.RpcError as exc:
            return exc


def test_unary_call_on_a_killed_replica_succeeds_by_grpcs_retry_policy() -> None:
    """pick_first over two replicas sends every call to the first; killing it under a call makes the
    call's attempt fail with UNAVAILABLE. The stream mover is off: with the retry policy gRPC sends it
    again to the second replica (same seed, same completion); with the policy off, the same call fails."""
    with ExitStack() as stack:
        a, b, c = (stack.enter_context(serve(None, 1, new_session=True)) for _ in range(3))
        with Client(f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}", load_balancing_policy="pick_first",
                    move_policy=MovePolicy(max_moves=0)) as client:
            result = _kill_under_a_call(client, a)
            assert not isinstance(result, grpc.RpcError), f"the call failed: {result}"
            assert result.usage.completion_tokens == LONG["max_tokens"]
        with Client(f"ipv4:127.0.0.1:{b.port},127.0.0.1:{c.port}", load_balancing_policy="pick_first",
                    move_policy=MovePolicy(max_moves=0), retry_policy=RetryPolicy(max_attempts=1)) as client:
            error = _kill_under_a_call(client, b)
            assert isinstance(error, grpc.RpcError), "the call succeeded without a retry policy"
            assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_full_queue_answers_resource_exhausted_with_pushback() -> None:
    """``--max-num-seqs 1 --max-queue-len 1``, kept full by two clients sending long requests back to back:
    a probe is refused with RESOURCE_EXHAUSTED and ``grpc-retry-pushback-ms``, the waiting request's wait
    so far (at least 100 ms, at most the time since the load began)."""
    with serve(None, 1, "--max-num-seqs", "1", "--max-queue-len", "1") as cluster:
        stop = threading.Event()

        def hold() -> None:
            with Client(cluster.target, retry_policy=RetryPolicy(max_attempts=1),
                        move_policy=MovePolicy(max_moves=0)) as client:
                while not stop.is_set():
                    try:
                        client.generate([5, 6, 7], timeout_s=120, **LONG)
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        load_began = time.monotonic()
        with ThreadPoolExecutor(2) as pool, grpc.insecure_channel(cluster.target) as channel:
            holders = [pool.submit(hold) for _ in range(2)]
            generate = generate_pb2_grpc.GenerationStub(channel).Generate
            try:
                deadline = time.monotonic() + 60
                while True:
                    assert time.monotonic() < deadline, "the queue was never full"
                    try:
                        generate(build_request([5, 6, 7], max_tokens=1), timeout=30)
                    except grpc.RpcError as exc:
                        error, since_load_ms = exc, (time.monotonic() - load_began) * 1000
                        break
                    time.sleep(0.01)
            finally:
                stop.set()
            for holder in holders:
                holder.result()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "the queue is full (1 requests waiting)"
    pushback = int(dict(error.trailing_metadata())[PUSHBACK_KEY])
    assert MIN_PUSHBACK_MS <= pushback <= max(min(since_load_ms, MAX_PUSHBACK_MS), MIN_PUSHBACK_MS)
