"""Abort lands wherever a request is, bulk Aborts are bounded and cheap, ``n`` is admitted whole
(docs/design/request-path.md, "Abort").

An in-process gRPC server with the real interceptor and both servicers (``tpserve.v1`` and
the engine protocol a gateway speaks) over a real :class:`Engine` and scheduler, whose
worker group is a stand-in that samples a fixed script (no processes, no model). The
grammar compile case runs a real :class:`GrammarCompiler` (child processes) on a schema
llguidance takes about half a second to build.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.errors import ErrorInterceptor
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.parallel_sampling import generate_n
from coordinator.request_table import MAX_ABORT_IDS
from coordinator.scheduler import Scheduler
from coordinator.sequence import FinishReason
from coordinator.server import GenerationServicer
from coordinator.validation import GenerateParams
from coordinator.vllm_engine_service import VllmEngineServicer
from tests.coordinator.fakes import MAX_MODEL_LEN, PROMPT, VOCAB_SIZE, FakeRankGroup, make_engine
from tpserve.embedded_model import default_model_dir
from tpserve.step import SamplingParams
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


def _engine(max_num_seqs: int = 8, max_queue_len: int = 64, num_blocks: int = 1024,
            **group_args) -> tuple[Engine, FakeRankGroup]:
    scheduler = Scheduler(BlockAllocator(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                          enable_prefix_caching=True)
    group = FakeRankGroup(**{"step_s": 0.002, **group_args})
    return make_engine(group=group, scheduler=scheduler, max_model_len=MAX_MODEL_LEN, max_queue_len=max_queue_len), group


@contextlib.asynccontextmanager
async def _serving(engine: Engine, grammars: GrammarCompiler | None = None) -> AsyncIterator[grpc.aio.Channel]:
    """Both public services of ``engine`` on a loopback port, the engine loop running; a channel to them."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    generation = GenerationServicer(engine, engine.tokenizer,
                                    pb.ModelInfo(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE), grammars=grammars)
    generate_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(generation, default_model_dir()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.create_task(engine.run())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        loop.cancel()
        await server.stop(None)
        await generation.close()


def _request(request_id: str, max_tokens: int, n: int = 1, **sampling) -> pb.GenerateRequest:
    """A tpserve.v1 request; ``ignore_eos`` unless it has a grammar (which refuses it): the script has no eos."""
    sampling.setdefault("ignore_eos", "response_format" not in sampling)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=PROMPT), sampling_params=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, n=n, **sampling))


def _vllm_request(request_id: str, max_tokens: int, **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=PROMPT), stream=True,
                               sampling_params=vpb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling))


async def _finishes(stream) -> dict[int, tuple[str, int]]:
    """Sample index -> (finish_reason, completion tokens) of a tpserve.v1 stream read to its end."""
    ends = {}
    async for message in stream:
        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            ends[message.index] = (pb.FinishReason.Name(message.finish_reason), message.usage.completion_tokens)
    return ends


async def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.002)


# -- item 5: an Abort lands wherever the request is ---------------------------------------------


def _slow_schema(salt: str) -> str:
    """``allOf`` of 7 three-way ``anyOf``s (3**7 alternatives): about 0.6 s to build on a quiet host
    (tests/coordinator/test_structured_output_limits.py); ``salt`` keeps the compiler's cache out."""
    return json.dumps({"allOf": [{"anyOf": [
        {"type": "object", "properties": {f"{salt}{i}_{j}": {"type": "integer"}}, "required": [f"{salt}{i}_{j}"]}
        for j in range(3)]} for i in range(7)]})


@pytest.mark.parametrize("api", ["tpserve.v1", "vllm"])
def test_an_abort_while_the_grammar_compiles_ends_the_request_before_it_runs(api: str) -> None:
    async def go() -> tuple[tuple, int, float]:
        engine, group = _engine()
        grammars = GrammarCompiler(default_model_dir(), VOCAB_SIZE, timeout_s=60, num_processes=1)
        try:
            async with _serving(engine, grammars) as channel:
                native = generate_pb2_grpc.GenerationStub(channel)
                gateway = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                # The child's start-up is not the compile: warm it with a schema that builds at once.
                warm = pb.ResponseFormat(json_schema=json.dumps({"type": "integer"}))
                assert (await _finishes(native.GenerateStream(_request("warm", 2, response_format=warm)))) \
                    == {0: ("FINISH_REASON_LENGTH", 2)}
                schema = _slow_schema(api[0])
                if api == "vllm":
                    stream = gateway.Generate(_vllm_request("slow", 200, json_schema=schema))
                else:
                    stream = native.GenerateStream(_request("slow", 200, response_format=pb.ResponseFormat(
                        json_schema=schema)))
                await asyncio.sleep(0.2)  # the compile has started and runs for about 0.6 s more
                aborted_at = time.monotonic()
                if api == "vllm":
                    await gateway.Abort(vpb.AbortRequest(request_ids=["slow"]))
                    num_aborted = 1
                    messages = [m async for m in stream]
                    end = (messages[-1].complete.finish_reason, messages[-1].complete.completion_tokens)
                else:
                    num_aborted = (await native.Abort(pb.AbortRequest(request_ids=["slow"]))).num_aborted
                    end = (await _finishes(stream))[0]
                ended_after = time.monotonic() - aborted_at
                assert engine.num_requests == 0
                return end, num_aborted, ended_after, len(group.seen)
        finally:
            grammars.close()

    end, num_aborted, ended_after, num_seqs_run = asyncio.run(go())
    # Before: the Abort found nothing (0) and the request ran to its length, 200 tokens.
    assert end in (("FINISH_REASON_ABORT", 0), ("abort", 0))
    assert num_aborted == 1
    assert num_seqs_run == 1  # only the warm-up ever reached a step
    assert ended_after < 0.5, f"the stream ended {ended_after:.2f} s after the Abort"


def test_an_abort_while_rank_0_builds_the_grammar_ends_the_request_at_once() -> None:
    async def go() -> tuple[dict, int, float]:
        engine, group = _engine(grammar_s=30.0)  # rank 0 would take 30 s
        async with _serving(engine) as channel:
            native = generate_pb2_grpc.GenerationStub(channel)
            stream = native.GenerateStream(_request("g", 50, response_format=pb.ResponseFormat(regex="[a-z]+")))
            await asyncio.sleep(0.3)
            start = time.monotonic()
            num_aborted = (await native.Abort(pb.AbortRequest(request_ids=["g"]))).num_aborted
            ends = await _finishes(stream)
            return ends, num_aborted, time.monotonic() - start

    ends, num_aborted, took = asyncio.run(go())
    assert ends == {0: ("FINISH_REASON_ABORT", 0)} and num_aborted == 1
    assert took < 1.0  # before: the stream waited out rank 0's build, then ran to its length


def test_an_abort_while_an_n_request_is_queued_ends_every_sample_unrun() -> None:
    """--max-num-seqs 1: a long request runs, an n=4 request waits; its Abort ends all 4 samples."""
    async def go() -> tuple[dict, int, set, int]:
        engine, group = _engine(max_num_seqs=1)
        async with _serving(engine) as channel:
            native = generate_pb2_grpc.GenerationStub(channel)
            blocker = native.GenerateStream(_request("blocker", 400))
            await blocker.read()
            queued = asyncio.ensure_future(_finishes(native.GenerateStream(_request("four", 8, n=4))))
            await _wait_until(lambda: len(engine.scheduler.waiting) == 1)
            num_aborted = (await native.Abort(pb.AbortRequest(request_ids=["four"]))).num_aborted
            ends = await asyncio.wait_for(queued, 10)
            waiting_after = len(engine.scheduler.waiting)
            await native.Abort(pb.AbortRequest(request_ids=["blocker"]))
            return ends, num_aborted, group.seen, waiting_after

    ends, num_aborted, seen, waiting_after = asyncio.run(go())
    # Before: sample 0 ended "abort"; samples 1 to 3 then started and ran to their length (8 tokens each).
    assert ends == {i: ("FINISH_REASON_ABORT", 0) for i in range(4)}
    assert num_aborted == 4
    assert seen == {0} and waiting_after == 0  # no sample ever reached a step


@pytest.mark.parametrize("when", ["during sample 0's prefill", "while all 4 stream"])
def test_aborting_an_n4_parent_ends_all_4_samples_and_frees_every_block(when: str) -> None:
    """Sample 0's prefill takes 0.3 s: an Abort then finds samples 1 to 3 not started (the issue's
    case); later, all 4 running (ended before the fix too: a regression check)."""
    async def go() -> tuple[dict, int, int, int, int]:
        engine, group = _engine(step_s=0.005, first_step_s=0.3)
        free_at_start = engine.scheduler.allocator.num_free_blocks
        async with _serving(engine) as channel:
            native = generate_pb2_grpc.GenerationStub(channel)
            stream = native.GenerateStream(_request("parent", 300, n=4))
            streamed: set[int] = set()
            ends: dict[int, tuple[str, int]] = {}
            num_aborted = -1
            if when.startswith("during"):
                await _wait_until(lambda: len(engine.scheduler.running) == 1)
                num_aborted = (await native.Abort(pb.AbortRequest(request_ids=["parent"]))).num_aborted
            async for message in stream:
                streamed.add(message.index)
                if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    ends[message.index] = (pb.FinishReason.Name(message.finish_reason),
                                           message.usage.completion_tokens)
                if num_aborted < 0 and len(streamed) == 4:
                    num_aborted = (await native.Abort(pb.AbortRequest(request_ids=["parent"]))).num_aborted
            await _wait_until(lambda: engine.num_requests == 0)
            return (ends, num_aborted, free_at_start, engine.scheduler.allocator.num_free_blocks,
                    len(engine.scheduler.waiting) + len(engine.scheduler.running) + len(engine.requests))

    ends, num_aborted, free_at_start, free_after, in_flight = asyncio.run(go())
    # Before ("during sample 0's prefill"): sample 0 ended "abort", samples 1-3 "length" with 300 tokens.
    assert set(ends) == {0, 1, 2, 3}
    assert all(reason == "FINISH_REASON_ABORT" and tokens < 300 for reason, tokens in ends.values()), ends
    assert num_aborted == 4
    assert free_after == free_at_start and in_flight == 0


# -- item 6: a bulk Abort is bounded, and cheap -----------------------------------------------------


def test_an_abort_list_over_the_limit_is_invalid_argument_on_both_services() -> None:
    async def go() -> list[tuple[grpc.StatusCode, str]]:
        engine, _ = _engine()
        results = []
        async with _serving(engine) as channel:
            native = generate_pb2_grpc.GenerationStub(channel)
            gateway = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            ids = [f"id-{i}" for i in range(MAX_ABORT_IDS)]
            assert (await native.Abort(pb.AbortRequest(request_ids=ids))).num_aborted == 0  # at the limit: fine
            await gateway.Abort(vpb.AbortRequest(request_ids=ids))
            for call in (native.Abort(pb.AbortRequest(request_ids=[*ids, "one-more"])),
                         gateway.Abort(vpb.AbortRequest(request_ids=[*ids, "one-more"]))):
                try:
                    await call
                    results.append((grpc.StatusCode.OK, ""))
                except grpc.aio.AioRpcError as exc:
                    results.append((exc.code(), exc.details()))
        return results

    # Before: both OK (nothing bounds the list).
    expected = f"request_ids has {MAX_ABORT_IDS + 1} ids; the limit is {MAX_ABORT_IDS} per Abort"
    assert asyncio.run(go()) == [(grpc.StatusCode.INVALID_ARGUMENT, expected)] * 2
    assert f"At most {MAX_ABORT_IDS} ids per call" in (REPO_ROOT / "proto/tpserve/v1/generate.proto").read_text()


def test_an_abort_ends_only_its_tenants_requests_and_the_table_forgets_every_request() -> None:
    """With API keys each key is a tenant: another tenant's Abort of the same id ends nothing."""
    async def go() -> tuple[int, int, list, int, int]:
        engine, _ = _engine(max_num_seqs=1, first_step_s=0.5)  # sample 1 waits 0.5 s for sample 0's prefill
        loop = asyncio.create_task(engine.run())
        try:
            mine = engine.requests.open("same-id", "tenant-a", 2)
            params = GenerateParams("same-id", PROMPT, 50, SamplingParams(temperature=0.0), (), frozenset(), True,
                                    tenant="tenant-a")
            outputs = []

            async def run() -> None:
                async for _, output in generate_n(engine, params, 2, entry=mine):
                    outputs.append(output)

            task = asyncio.ensure_future(run())
            await _wait_until(lambda: len(engine.scheduler.running) == 1)
            assert engine.requests.num_reserved == 1  # sample 1's place, held while sample 0 prefills
            others = engine.abort_requests(["same-id"], tenant="tenant-b")
            own = engine.abort_requests(["same-id"], tenant="tenant-a")
            await asyncio.wait_for(task, 10)
            engine.requests.close(mine)
            return others, own, [o.finish_reason for o in outputs if o.finish_reason], len(engine.requests), \
                engine.requests.num_reserved
        finally:
            loop.cancel()

    others, own, finishes, num_entries, num_reserved = asyncio.run(go())
    assert (others, own) == (0, 2)
    assert finishes == [FinishReason.ABORT, FinishReason.ABORT]
    assert (num_entries, num_reserved) == (0, 0)


@pytest.mark.parametrize("api", ["tpserve.v1", "vllm"])
def test_a_bulk_abort_does_not_stall_a_running_stream(api: str) -> None:
    """3,000 requests queued behind one stream; an Abort of MAX_ABORT_IDS ids (64 of them queued):
    the stream's largest gap between tokens while the Abort runs stays near its usual one."""
    num_queued, num_named = 3000, 64

    async def go() -> tuple[float, float, int]:
        engine, _ = _engine(max_num_seqs=1, max_queue_len=4096, num_blocks=4096)
        async with _serving(engine) as channel:
            native = generate_pb2_grpc.GenerationStub(channel)
            gateway = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            stream = native.GenerateStream(_request("runner", 3000))
            await stream.read()

            async def queued(i: int) -> None:  # straight into the engine: not 3,000 gRPC calls
                async for _ in engine.generate(GenerateParams(f"queued-{i}", PROMPT, 4, SamplingParams(temperature=0.0),
                                                              (), frozenset(), True)):
                    pass

            waiters = [asyncio.ensure_future(queued(i)) for i in range(num_queued)]
            await _wait_until(lambda: len(engine.scheduler.waiting) == num_queued)
            arrivals = []
            for _ in range(100):
                await stream.read()
                arrivals.append(time.monotonic())
            baseline = max(b - a for a, b in zip(arrivals, arrivals[1:]))
            ids = [f"queued-{i}" for i in range(num_named)] + [f"absent-{i}" for i in range(MAX_ABORT_IDS - num_named)]
            call = (native.Abort(pb.AbortRequest(request_ids=ids)) if api == "tpserve.v1"
                    else gateway.Abort(vpb.AbortRequest(request_ids=ids)))
            abort = asyncio.ensure_future(call)
            arrivals = [time.monotonic()]
            while not abort.done() or len(arrivals) < 5:
                await stream.read()
                arrivals.append(time.monotonic())
            during = max(b - a for a, b in zip(arrivals, arrivals[1:]))
            await abort
            num_left = len(engine.scheduler.waiting)
            await native.Abort(pb.AbortRequest(request_ids=["runner"] + [f"queued-{i}" for i in range(num_queued)]))
            await asyncio.gather(*waiters)
            return baseline, during, num_left

    baseline, during, num_left = asyncio.run(go())
    assert num_left == num_queued - num_named
    # Before: 0.3-1 s (every id compared with every request in flight, on the event loop).
    print(f"largest gap during the Abort {during * 1000:.1f} ms, usual {baseline * 1000:.1f} ms")
    assert during < max(0.1, 3 * baseline), f"largest gap {during * 1000:.0f} ms (usual {baseline * 1000:.0f} ms)"


# -- item 9: n is admitted as one ------------------------------------------------------------------


def test_n_over_a_bounded_queue_is_refused_whole_before_any_sample_streams() -> None:
    async def go(n: int, queued_first: int) -> tuple[list, grpc.StatusCode, str, dict, set]:
        engine, group = _engine(max_num_seqs=1, max_queue_len=8, first_step_s=0.5)
        async with _serving(engine) as channel:
            native = generate_pb2_grpc.GenerationStub(channel)
            earlier = [asyncio.ensure_future(native.Generate(_request(f"early{i}", 2))) for i in range(queued_first)]
            await _wait_until(lambda: len(engine.scheduler.running) + len(engine.scheduler.waiting) == queued_first)
            messages = []
            try:
                async for message in native.GenerateStream(_request("many", 8, n=n)):
                    messages.append(message)
                code, details, trailing = grpc.StatusCode.OK, "", {}
            except grpc.aio.AioRpcError as exc:
                code, details, trailing = exc.code(), exc.details(), dict(exc.trailing_metadata() or ())
            await asyncio.gather(*earlier)
            return messages, code, details, trailing, set(group.seen)

    # More samples than the queue ever holds: refused whole, and no pushback (a retry cannot succeed).
    # Before: sample 0 streamed its tokens, then the stream failed RESOURCE_EXHAUSTED; later, a retryable pushback.
    messages, code, details, trailing, seen = asyncio.run(go(16, 0))
    assert (len(messages), code, seen) == (0, grpc.StatusCode.RESOURCE_EXHAUSTED, set())
    assert details == ("the request's n=16 samples can never all wait: the queue holds at most 8 (--max-queue-len); "
                       "none was started")
    assert trailing["grpc-retry-pushback-ms"] == "-1"
    # Samples that fit the queue but not its free places now: refused whole, with a pushback to retry after.
    messages, code, details, trailing, seen = asyncio.run(go(7, 3))
    assert (len(messages), code, len(seen)) == (0, grpc.StatusCode.RESOURCE_EXHAUSTED, 3)  # the 3 earlier requests
    assert details == "the request's n=7 samples do not fit in the queue (2 of 8 places taken); none was started"
    assert int(trailing["grpc-retry-pushback-ms"]) >= 0


def test_an_admitted_n_request_keeps_its_queue_places_until_its_samples_start() -> None:
    """--max-queue-len 16, --max-num-seqs 1: an n=16 request is admitted; while its first sample's
    prefill runs (its other 15 not queued yet), two requests arrive: one place is free, the other
    is refused, and all 16 samples run to their end."""
    async def go() -> tuple[dict | str, list]:
        engine, _ = _engine(max_num_seqs=1, max_queue_len=16, first_step_s=0.5)
        async with _serving(engine) as channel:
            native = generate_pb2_grpc.GenerationStub(channel)
            sixteen = asyncio.ensure_future(_finishes(native.GenerateStream(_request("sixteen", 6, n=16))))
            await _wait_until(lambda: len(engine.scheduler.running) == 1)  # sample 0's prefill step runs

            async def late(name: str) -> str:
                try:
                    return pb.FinishReason.Name((await native.Generate(_request(name, 2))).finish_reason)
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name

            lates = asyncio.gather(late("late-1"), late("late-2"))
            try:
                ends: dict | str = await sixteen
            except grpc.aio.AioRpcError as exc:
                ends = exc.code().name
            return ends, sorted(await lates)

    ends, lates = asyncio.run(go())
    # Before: both late requests were queued, and the n=16 stream failed RESOURCE_EXHAUSTED at its
    # 15th sample, after sample 0 had streamed all its tokens.
    assert ends == {i: ("FINISH_REASON_LENGTH", 6) for i in range(16)}
    assert lates == ["FINISH_REASON_LENGTH", "RESOURCE_EXHAUSTED"]
