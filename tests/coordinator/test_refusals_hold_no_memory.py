"""A refused request leaves nothing behind for the cyclic collector (coordinator/errors.py ``_abort``).

gRPC's ``context.abort`` raises inside the interceptor's ``except``: the AbortError, its context (our error), their
tracebacks' frames and the call's state form a cycle that only the cyclic collector frees, which the server runs
every 50,000 allocations (coordinator/gc_policy.py). The frames that raised the error held the request's prompt:
a 100,000-token prompt refused as too long kept about 3 MB until a collection (4.7 MB per refusal on a live
server, 81 -> 508 MiB over 90 refusals); now its memory goes when the call ends, by reference counting alone.
"""

from __future__ import annotations

import asyncio
import gc

import grpc

from tests.coordinator.timed_engine import make_engine, serving
from tpserve.v1 import generate_pb2 as pb

NUM_TOKENS = 100_000


def _prompt_lists() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is list and len(o) == NUM_TOKENS)


def test_refused_long_prompts_are_freed_without_a_collection() -> None:
    async def run() -> tuple[list[grpc.StatusCode], int]:
        engine = make_engine()
        loop = asyncio.create_task(engine.run())
        codes = []
        async with serving(engine) as (stub, _):
            gc.collect()
            gc.disable()  # as between the server's rare collections
            try:
                for i in range(8):
                    try:
                        await stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[300 + i] * NUM_TOKENS)),
                                            timeout=30)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                await asyncio.sleep(0.1)
                left = _prompt_lists()
            finally:
                gc.enable()
        loop.cancel()
        return codes, left

    codes, left = asyncio.run(run())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 8
    assert left == 0, f"{left} refused prompts' id lists still alive"
