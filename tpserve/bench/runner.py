"""Runs one load against a live server and measures every request from its stream.

Data flow: the requests (datasets.py) are sent at the arrival offsets (arrivals.py) over
one ``grpc.aio`` channel; each GenerateStream's messages are timed as they arrive
(``time.perf_counter``) into a RequestRecord, and the records are summarized with
vLLM's metric definitions (metrics.py). Each request gets its own asyncio task, so
a slow stream never delays the send of the next one.

Ctrl-C during a load (asyncio.run cancels the load's task) ends it: :func:`run` raises
:class:`LoadInterrupted` with the requests that had ended, summarized over the time until then.
"""

from __future__ import annotations

import asyncio
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


class LoadInterrupted(Exception):
    """Ctrl-C (SIGINT) ended a load; ``run`` is what the requests that ended before it measured."""

    def __init__(self, run: RunResult) -> None:
        super().__init__(f"interrupted after {len(run.records)} requests ended")
        self.run = run


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
                    credentials: Credentials = Credentials(), partial: list[RunResult] | None = None) -> RunResult:
    """Sends ``requests`` to the server at ``target`` under ``config``; returns the measured run.

    ``credentials``: TLS files and API key for a secured server. ``partial``: where a load cancelled after
    its warm-up leaves what it measured (a RunResult of the requests that had ended) before the
    cancellation goes on.
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
                ended.append(record)
                progress.update(1)
                return record

            ended: list[RequestRecord] = []
            t0 = time.perf_counter()
            try:
                records = await run_load(requests, send, offsets, config.max_concurrency)
            except asyncio.CancelledError:
                # Taken now: closing the channel next ends the requests in flight, as CANCELLED failures of our own.
                if partial is not None:
                    done = sorted(ended, key=lambda record: record.index)
                    partial.append(RunResult(config.request_rate, done,
                                             summarize(done, time.perf_counter() - t0, config.slos_ms)))
                raise
            duration_s = time.perf_counter() - t0
    return RunResult(config.request_rate, records, summarize(records, duration_s, config.slos_ms))


def run(target: str, requests: Sequence[SampleRequest], config: LoadConfig,
        credentials: Credentials = Credentials()) -> RunResult:
    """Blocking :func:`run_async`, on uvloop where installed: the client shares the host's cores with
    the server under test, and a cheaper loop takes less from it (tpserve/event_loop.py).

    Raises:
        LoadInterrupted: Ctrl-C during the load (after the warm-up); it holds the requests that had ended.
        KeyboardInterrupt: Ctrl-C before the load.
    """
    partial: list[RunResult] = []
    try:
        return event_loop.run(run_async(target, requests, config, credentials, partial))
    except KeyboardInterrupt:
        if not partial:
            raise
        raise LoadInterrupted(partial[0]) from None
