"""``abort`` on both clients against a real server (tests/e2e/cluster.py ``serve``, through the shared
servers): running streams end with finish reason "abort" long before ``max_tokens``, the call counts
the samples it ended, and an unknown id counts 0; over two replicas behind one ``ipv4:`` target, the abort
reaches the replica that runs the stream, whichever that is. The two clients' parity without a server:
tests/test_client_parity.py.
"""

from __future__ import annotations

import asyncio

from tests.e2e.cluster import SharedServers
from tpserve.client import AsyncClient, Client
from tpserve.stream_move import MovePolicy

#: Far more tokens than the streams get before the abort: the embedded model would need minutes for them.
MAX_TOKENS = 4000
STREAM = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=120)


def test_client_abort_ends_the_named_stream_only(shared_servers: SharedServers) -> None:
    cluster = shared_servers.get(None, 1)
    with Client(cluster.target, move_policy=MovePolicy(max_moves=0)) as client:
        aborted = client.generate_stream("Once upon a time", request_id="abort-sync-1", **STREAM)
        kept = client.generate_stream("Once upon a time", request_id="abort-sync-2", **STREAM)
        next(aborted), next(kept)  # both running
        assert client.abort("abort-no-such-request") == 0
        assert client.abort("abort-sync-1") == 1
        last = list(aborted)[-1]
        assert last.finish_reason == "abort" and 0 < last.usage.completion_tokens < MAX_TOKENS
        assert next(kept).finish_reason is None  # the other stream still runs
        assert client.abort("abort-sync-2", "abort-no-such-request") == 1
        assert list(kept)[-1].finish_reason == "abort"
        assert client.abort("abort-sync-1") == 0  # ended: nothing left to abort


def test_async_client_abort_ends_several_streams_in_one_call(shared_servers: SharedServers) -> None:
    cluster = shared_servers.get(None, 1)

    async def run() -> list[tuple[str | None, int]]:
        async with AsyncClient(cluster.target, move_policy=MovePolicy(max_moves=0)) as client:
            ids = ["abort-async-1", "abort-async-2"]
            streams = [client.generate_stream("Once upon a time", request_id=i, **STREAM).__aiter__() for i in ids]
            for stream in streams:
                await stream.__anext__()  # running
            assert await client.abort("abort-no-such-request") == 0
            assert await client.abort(*ids) == 2
            ends = []
            for stream in streams:
                chunks = [chunk async for chunk in stream]
                ends.append((chunks[-1].finish_reason, chunks[-1].usage.completion_tokens))
            assert await client.abort(*ids) == 0
            return ends

    ends = asyncio.run(run())
    assert [reason for reason, _ in ends] == ["abort", "abort"]
    assert all(0 < completion_tokens < MAX_TOKENS for _, completion_tokens in ends)


def test_abort_over_two_replicas_ends_the_stream_on_whichever_runs_it(shared_servers: SharedServers) -> None:
    # Two shared servers that differ only in a flag these streams do not feel (one stream each at a time).
    first, second = shared_servers.get(None, 1), shared_servers.get(None, 1, "--max-num-seqs", "1")
    target = f"ipv4:{first.target},{second.target}"
    with Client(target, move_policy=MovePolicy(max_moves=0)) as client:
        client.wait_ready(timeout_s=60)
        # round_robin alternates the calls over the two replicas: a stream, then its abort, would land on
        # different replicas every time if the abort went over the balanced channel.
        for trial in range(3):
            stream = client.generate_stream("Once upon a time", request_id=f"abort-two-{trial}", **STREAM)
            next(stream)  # running on one of the two
            assert client.abort(f"abort-two-{trial}") == 1, trial
            last = list(stream)[-1]
            assert last.finish_reason == "abort" and 0 < last.usage.completion_tokens < MAX_TOKENS

    async def run() -> list[int]:
        counts = []
        async with AsyncClient(target, move_policy=MovePolicy(max_moves=0)) as client:
            for trial in range(2):
                stream = client.generate_stream("Once upon a time", request_id=f"abort-two-async-{trial}",
                                                **STREAM).__aiter__()
                await stream.__anext__()
                counts.append(await client.abort(f"abort-two-async-{trial}"))
                assert [chunk async for chunk in stream][-1].finish_reason == "abort"
        return counts

    assert asyncio.run(run()) == [1, 1]


def test_leaving_an_async_stream_early_ends_the_request_and_cancel_raises_rpc_error(
        shared_servers: SharedServers) -> None:
    """``break`` out of ``async for`` ended nothing: grpc.aio keeps a call running while its stream object lives, so
    the request ran to max_tokens (its slot and KV blocks held) until the client closed; the blocking stream ends
    it at once. And ``stream.cancel()`` made the loop raise ``asyncio.CancelledError``, not ``grpc.RpcError``."""
    import grpc

    cluster = shared_servers.get(None, 1)

    async def run() -> tuple[list[float], grpc.StatusCode]:
        async with AsyncClient(cluster.target, move_policy=MovePolicy(max_moves=0)) as client:
            stream = client.generate_stream("Once upon a time", **STREAM)  # the object outlives the loop
            async for _ in stream:
                break
            running = []
            for _ in range(50):  # the server sees the cancel within a step or two
                await asyncio.sleep(0.1)
                running.append(cluster.metric("tpserve:num_requests_running"))
                if running[-1] == 0:
                    break
            cancelled = client.generate_stream("Once upon a time", **STREAM)
            asyncio.get_running_loop().call_later(0.3, cancelled.cancel)
            try:
                async for _ in cancelled:
                    pass
            except grpc.RpcError as exc:
                return running, exc.code()
            raise AssertionError("the cancelled stream ended without an error")

    running, code = asyncio.run(run())
    assert running[-1] == 0, running
    assert code == grpc.StatusCode.CANCELLED
