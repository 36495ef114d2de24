"""Runs one load against a live server and measures every request from its stream.

Data flow: the requests (datasets.py) are sent at the arrival offsets (arrivals.py) over
one ``grpc.aio`` channel; each GenerateStream's messages are timed as they arrive
(``time.perf_counter``) into a RequestRecord, and the records are summarized with
vLLM's metric definitions (metrics.py). Each request gets its own asyncio task, so
a slow stream never delays the send of the next one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from tpserve import event_loop
from tpserve.bench.arrivals import arrival_offsets, run_load
from tpserve.bench.datasets import SampleRequest
from tpserve.bench.metrics import RequestRecord, SloName, summarize
from tpserve.client import FINISH_REASON_NAMES, Credentials, build_request
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How one load is sent: arrivals, concurrency cap, sampling, per-request deadline (seconds)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout_s: float | None = None
    num_warmups: int = 0
    slos_ms: dict[SloName, float] = field(default_factory=dict)
    show_progress: bool = True


@dataclass
class RunResult:
    """One load's records (in request order) and their summary."""

    request_rate: float
    records: list[RequestRecord]
    summary: dict


def _grpc_request(sample: SampleRequest, index: int, config: LoadConfig):
    # A seed per request makes a sampled (temperature > 0) run reproducible; greedy ignores it.
    return build_request(sample.prompt, max_tokens=sample.max_tokens, temperature=config.temperature,
                         seed=config.seed + index, ignore_eos=config.ignore_eos)


async def stream_one(stub: generate_pb2_grpc.GenerationStub, index: int, sample: SampleRequest,
                     config: LoadConfig, t0: float) -> RequestRecord:
    """Sends one GenerateStream and times its messages; gRPC errors become the record's status."""
    sent = time.perf_counter()
    record = RequestRecord(index=index, start_s=sent - t0, max_tokens=sample.max_tokens)
    last = None
    try:
        async for message in stub.GenerateStream(_grpc_request(sample, index, config),
                                                 timeout=config.request_timeout_s):
            record.add_chunk(time.perf_counter() - sent, len(message.token_ids))
            last = message
    except grpc.aio.AioRpcError as exc:
        record.fail(exc.code().name, exc.details() or "")
        return record
    close_record(record, last)
    return record


def close_record(record: RequestRecord, last: pb.GenerateStreamResponse | None) -> None:
    """Completes a record from its stream's last message (None: the stream sent nothing)."""
    if last is None:
        record.fail("INCOMPLETE_STREAM", "the stream ended without a message")
    else:
        record.finish(FINISH_REASON_NAMES.get(last.finish_reason), last.usage.prompt_tokens,
                      last.usage.completion_tokens)


async def run_async(target: str, requests: Sequence[SampleRequest], config: LoadConfig,
                    credentials: Credentials = Credentials()) -> RunResult:
    """Sends ``requests`` to the server at ``target`` under ``config``; returns the measured run.

    ``credentials``: TLS files and API key for a secured server.
    """
    from tqdm import tqdm  # imported here: `tpserve --help` should not pay for it

    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    async with credentials.aio_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for index in range(config.num_warmups):  # not measured: warms caches and connections
            await stream_one(stub, index % len(requests), requests[index % len(requests)], config, time.perf_counter())
        with tqdm(total=len(requests), desc=f"request rate {config.request_rate:g}/s", unit="req",
                  disable=not config.show_progress) as progress:

            async def send(index: int, sample: SampleRequest) -> RequestRecord:
                record = await stream_one(stub, index, sample, config, t0)
                progress.update(1)
                return record

            t0 = time.perf_counter()
            records = await run_load(requests, send, offsets, config.max_concurrency)
            duration_s = time.perf_counter() - t0
    return RunResult(config.request_rate, records, summarize(records, duration_s, config.slos_ms))


def run(target: str, requests: Sequence[SampleRequest], config: LoadConfig,
        credentials: Credentials = Credentials()) -> RunResult:
    """Blocking :func:`run_async`, on uvloop where installed: the client shares the host's cores with
    the server under test, and a cheaper loop takes less from it (tpserve/event_loop.py)."""
    return event_loop.run(run_async(target, requests, config, credentials))
