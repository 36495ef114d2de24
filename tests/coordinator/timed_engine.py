"""A scripted engine and the helpers that time its requests, shared by the request-timing and tracing tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.errors import ErrorInterceptor
from coordinator.scheduler import Scheduler
from coordinator.server import GenerationServicer
from tests.coordinator import fakes
from tests.coordinator.fakes import MAX_MODEL_LEN, PROMPT, VOCAB_SIZE, FakeRankGroup
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

MODEL_NAME = "tiny"


def make_engine(max_num_seqs: int = 8, num_blocks: int = 1024, **group_args) -> Engine:
    """A real engine (blocks of 4 tokens, prefix caching) over a FakeRankGroup (SCRIPT, 2 ms a step)."""
    scheduler = Scheduler(BlockAllocator(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                          enable_prefix_caching=True)
    return fakes.make_engine(group=FakeRankGroup(**{"step_s": 0.002, **group_args}), scheduler=scheduler,
                       max_model_len=MAX_MODEL_LEN, max_queue_len=64)


@contextlib.asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[tuple[generate_pb2_grpc.GenerationStub, int]]:
    """``engine``'s Generation service on a loopback port, its loop running: a stub and the port."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    generation = GenerationServicer(engine, engine.tokenizer, pb.ModelInfo(
        model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE))
    generate_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.create_task(engine.run())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield generate_pb2_grpc.GenerationStub(channel), port
    finally:
        loop.cancel()
        await server.stop(None)
        await generation.close()


def request(request_id: str, max_tokens: int, prompt: list[int] = PROMPT) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling_params=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def timed_stream(stub, req: pb.GenerateRequest, metadata=()) -> tuple[list[pb.GenerateStreamResponse], float]:
    """Every message of a stream and the client's wall time from the call to the last message, in s."""
    start = time.monotonic()
    messages = [message async for message in stub.GenerateStream(req, metadata=metadata)]
    return messages, time.monotonic() - start
