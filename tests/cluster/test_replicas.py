"""Replicas behind one name, balanced by the client, and the asyncio client, against live servers.

Two independent single-host replicas of stories260k listen on two loopback ports;
one ``ipv4:127.0.0.1:P1,127.0.0.1:P2`` target stands for the name a headless
Kubernetes Service resolves to. Each replica's own /metrics counts the requests it
served. The references are the shared goldens (made with Hugging Face ``transformers``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress

import grpc
import pytest

from tests.cluster.two_hosts import SERVICE_LINK_ENV, assert_matches_golden
from tests.e2e.cluster import RunningCluster, serve
from tests.paths import STORIES_DIR, load_goldens, requires_stories
from tpserve.client import AsyncClient, Client

pytestmark = [pytest.mark.e2e, requires_stories]

REQUESTS_SERVED = "tpserve:e2e_request_latency_seconds_count"


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[RunningCluster, RunningCluster]]:
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            # Kubernetes' service links in the servers' environment must not be read as ports.
            for name, value in SERVICE_LINK_ENV.items():
                env.setenv(name, value)
            first = stack.enter_context(serve(STORIES_DIR, 1))
            second = stack.enter_context(serve(STORIES_DIR, 1))
        yield first, second


def served(replicas) -> list[float]:
    return [replica.metric(REQUESTS_SERVED) for replica in replicas]


def test_round_robin_spreads_requests_over_both_replicas_and_every_answer_is_right(replicas) -> None:
    goldens = load_goldens()
    before = served(replicas)
    target = ",".join(f"127.0.0.1:{replica.port}" for replica in replicas)
    with Client(f"ipv4:{target}") as client:
        client.wait_ready(timeout_s=10)
        batch = [goldens[i % len(goldens)] for i in range(20)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(
                lambda g: client.generate(g["prompt"], max_tokens=g["max_tokens"], temperature=0), batch))
    for result, golden in zip(results, batch):
        assert_matches_golden(result, golden)
    landed = [after - b for after, b in zip(served(replicas), before)]
    assert sum(landed) == 20 and min(landed) >= 5, landed  # round_robin: ~10 each


def test_pick_first_would_pin_every_request_to_one_replica(replicas) -> None:
    before = served(replicas)
    target = ",".join(f"127.0.0.1:{replica.port}" for replica in replicas)
    with Client(f"ipv4:{target}", load_balancing_policy="pick_first") as client:
        for _ in range(6):
            client.generate("Once upon a time", max_tokens=2, temperature=0)
    landed = sorted(after - b for after, b in zip(served(replicas), before))
    assert landed == [0, 6]  # why the client library defaults to round_robin


def test_async_client_unary_and_stream_give_the_goldens(replicas) -> None:
    goldens = load_goldens()

    async def main():
        async with AsyncClient(replicas[0].target) as client:
            await client.wait_ready(timeout_s=10)
            info = await client.model_info()
            unary = await asyncio.gather(*(client.generate(g["prompt"], max_tokens=g["max_tokens"], temperature=0)
                                           for g in goldens))
            chunks = [chunk async for chunk in client.generate_stream(goldens[0]["prompt"], max_tokens=64,
                                                                      temperature=0)]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client.generate("Hi", top_p=2.0)
            return info, unary, chunks, bad.value

    info, unary, chunks, bad = asyncio.run(main())
    assert (info.model_name, info.tensor_parallel_size) == ("stories260k", 1)
    for result, golden in zip(unary, goldens):
        assert_matches_golden(result, golden)
    assert "".join(c.text for c in chunks) == goldens[0]["text"]
    assert [t for c in chunks for t in c.token_ids] == goldens[0]["completion_token_ids"]
    assert len(chunks) > 10 and chunks[-1].usage.completion_tokens == 64
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad.details()


def wait_all_blocks_free(replica: RunningCluster, timeout_s: float = 10.0) -> None:
    total = replica.metric("tpserve:kv_cache_total_blocks")
    deadline = time.monotonic() + timeout_s
    while replica.metric("tpserve:kv_cache_free_blocks") != total:
        assert time.monotonic() < deadline, "KV blocks were not freed"
        time.sleep(0.05)
    assert replica.metric("tpserve:num_requests_running") == 0


def test_async_client_cancellation_frees_the_requests_blocks(replicas) -> None:
    replica = replicas[0]
    long = dict(max_tokens=400, temperature=0, ignore_eos=True)

    async def cancel_the_call(client: AsyncClient) -> tuple[bool, grpc.StatusCode]:
        call = client.generate_stream("Once upon a time", **long)
        received = 0
        async for _ in call:
            received += 1
            if received == 5:
                break
        holding = replica.metric("tpserve:kv_cache_free_blocks") < replica.metric("tpserve:kv_cache_total_blocks")
        call.cancel()
        return holding, await call.code()

    async def cancel_the_task(client: AsyncClient) -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in client.generate_stream("The dog", **long):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 10)
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task

    async def main():
        async with AsyncClient(replica.target) as client:
            result = await cancel_the_call(client)
            wait_all_blocks_free(replica)
            await cancel_the_task(client)
            return result

    holding, code = asyncio.run(main())
    assert holding  # the running request held blocks ...
    assert code == grpc.StatusCode.CANCELLED
    wait_all_blocks_free(replica)  # ... and both ways of cancelling freed them
