"""Per-request timings on the last message (docs/design/observability.md, "Request timings and tracing"): queue,
prefill, decode, time to
first token, preemptions, cached prompt tokens and the replica, adding up to the wall time.

An in-process gRPC server over a real :class:`Engine` and scheduler whose worker group is a
stand-in that samples a fixed script, ``step_s`` seconds a step and ``first_step_s`` for the
step that prefills (tests/coordinator/test_abort_races.py's ScriptedGroup).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

import pytest

from coordinator import tracing
from coordinator.request_table import RequestEntry
from coordinator.request_timeline import replica_name, stamp_timings, timings_of
from coordinator.sequence import Sequence, StopParams
from tests.coordinator.timed_engine import make_engine, request, serving, timed_stream
from tpserve.client import GenerateResult, Usage
from tpserve.results import timings_of as client_timings_of
from tpserve.step import SamplingParams
from tpserve.v1 import generate_pb2 as pb


@pytest.fixture(autouse=True)
def _pod_name(monkeypatch):
    monkeypatch.setenv("POD_NAME", "tpserve-0")


def test_the_last_stream_message_carries_timings_that_add_up_to_the_wall_time() -> None:
    """10 ms steps, 10 tokens: prefill ~10 ms (one step), decode ~90 ms (9 steps), and queue +
    prefill + decode within 10 ms of what the client measured."""
    async def main():
        async with serving(make_engine(step_s=0.010)) as (stub, _):
            await stub.Generate(request("warm", 2, [1, 7]))  # the channel's set-up is not the request's
            return await timed_stream(stub, request("r1", 10))

    messages, wall_s = asyncio.run(main())
    assert all(not m.HasField("timings") for m in messages[:-1])
    t = messages[-1].timings
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert t.replica == "tiny@tpserve-0"
    assert 0.009 <= t.prefill_time_s < 0.050
    assert 0.085 <= t.decode_time_s < 0.200  # 9 decode steps of 10 ms after the first token
    assert 0.0 <= t.queue_time_s < 0.030
    assert t.time_to_first_token_s == pytest.approx(t.queue_time_s + t.prefill_time_s, abs=1e-9)
    assert t.num_preemptions == 0 and t.cached_prompt_tokens == 0
    total = t.queue_time_s + t.prefill_time_s + t.decode_time_s
    assert total <= wall_s and wall_s - total < 0.010, (total, wall_s)


def test_a_request_behind_a_full_batch_reports_its_queue_time_and_the_cache_it_found() -> None:
    """max_num_seqs=1: the second request waits for the first (10 tokens x 10 ms); it then finds
    the first's two full prompt blocks in the prefix cache."""
    async def main():
        async with serving(make_engine(max_num_seqs=1, step_s=0.010)) as (stub, _):
            first = asyncio.ensure_future(stub.Generate(request("a", 10)))
            await asyncio.sleep(0.005)
            second = await stub.Generate(request("b", 3))
            return await first, second

    first, second = asyncio.run(main())
    assert first.timings.queue_time_s < 0.030
    assert second.timings.queue_time_s > 0.080  # waited for the first's ~100 ms, less the 5 ms head start
    assert second.timings.queue_time_s > first.timings.queue_time_s + first.timings.prefill_time_s
    assert second.timings.cached_prompt_tokens == 8 == second.usage.cached_prompt_tokens  # 2 blocks of 4
    assert first.timings.cached_prompt_tokens == 0


def test_preemptions_are_counted_per_request() -> None:
    """12 blocks of 4 tokens; two requests of 10 + 20 tokens (8 blocks each) cannot both finish
    running: one is preempted; its count is reported, and equals the scheduler's."""
    async def main():
        engine = make_engine(num_blocks=12, step_s=0.002)
        async with serving(engine) as (stub, _):
            results = await asyncio.gather(stub.Generate(request("a", 20)), stub.Generate(request("b", 20)))
        return results, engine.scheduler.num_preemptions

    results, num_preemptions = asyncio.run(main())
    assert num_preemptions >= 1
    assert sum(r.timings.num_preemptions for r in results) == num_preemptions
    assert all(len(r.token_ids) == 20 for r in results)


def test_timings_of_clamps_the_instants_into_order_and_adds_up() -> None:
    seq = Sequence(0, [1, 2, 3], SamplingParams(), StopParams(4), 64)
    seq.admitted_s.extend([10.5, 11.5])
    seq.preempted_s.append(11.2)
    seq.num_preemptions = 1
    t = timings_of(10.0, seq, 11.0, 12.0)
    assert (t.queue_time_s, t.prefill_time_s, t.decode_time_s, t.time_to_first_token_s) == (0.5, 0.5, 1.0, 1.0)
    assert t.e2e_time_s == 2.0 and t.preempted_s == (11.2,) and t.resumed_s == (11.5,)
    never_admitted = timings_of(10.0, Sequence(1, [1], SamplingParams(), StopParams(4), 64), None, 10.25)
    assert (never_admitted.queue_time_s, never_admitted.prefill_time_s, never_admitted.decode_time_s) == (0.25, 0, 0)
    assert never_admitted.admitted_s is None and never_admitted.time_to_first_token_s == 0.0


def test_replica_name_prefers_the_pod_name(monkeypatch) -> None:
    assert replica_name("llama") == "llama@tpserve-0"
    monkeypatch.delenv("POD_NAME")
    monkeypatch.setenv("HOSTNAME", "node-3")
    assert replica_name("llama") == "llama@node-3"


def test_with_tracing_off_a_request_end_touches_no_tracing(monkeypatch) -> None:
    """Off, stamp_timings only computes the timings: no span is written, no trace context kept."""
    assert not tracing.enabled()
    monkeypatch.setattr(tracing, "_record", lambda *args: pytest.fail("recorded with tracing off"))
    from coordinator.request_output import aborted_output

    entry = RequestEntry("r", "")
    output = stamp_timings(aborted_output("r", 3), entry, None)
    assert output.timings is not None and output.timings.num_preemptions == 0
    assert entry.trace_context is None and entry.traced_samples is None


def test_the_client_and_generate_json_expose_the_timings() -> None:
    message = pb.GenerateResponse(timings=pb.RequestTimings(
        queue_time_s=0.25, prefill_time_s=0.5, decode_time_s=1.0, time_to_first_token_s=0.75, num_preemptions=2,
        cached_prompt_tokens=16, replica="tiny@tpserve-0"))
    timings = client_timings_of(message)
    assert timings is not None and timings.e2e_time_s == 1.75
    result = GenerateResult("r", "x", [5], "stop", Usage(3, 1), timings=timings)
    assert result.to_json_dict()["timings"] == {
        "queue_time_s": 0.25, "prefill_time_s": 0.5, "decode_time_s": 1.0, "time_to_first_token_s": 0.75,
        "num_preemptions": 2, "cached_prompt_tokens": 16, "replica": "tiny@tpserve-0"}
    assert client_timings_of(pb.GenerateStreamResponse()) is None  # mid-stream, or an older server
    assert "timings" not in GenerateResult("r", "x", [5], "stop", Usage(3, 1)).to_json_dict()


@contextlib.contextmanager
def served_in_a_thread() -> Iterator[int]:
    """A scripted engine's Generation service on its own event loop thread; yields its port."""
    started, port = threading.Event(), []
    loop = asyncio.new_event_loop()
    stop = loop.create_future()

    async def run() -> None:
        async with serving(make_engine(step_s=0.002)) as (_, bound):
            port.append(bound)
            started.set()
            await stop

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(30), "the server did not start"
    try:
        yield port[0]
    finally:
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(30)
        loop.close()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_tpserve_generate_json_prints_the_timings(capsys, stream: bool) -> None:
    from tpserve.cli import build_parser, run_client_command

    with served_in_a_thread() as port:
        argv = ["generate", "--target", f"127.0.0.1:{port}", "--json", "--max-tokens", "4", "--temperature", "0",
                "--ignore-eos", *(["--stream"] if stream else []), "Once upon a time"]
        assert run_client_command(build_parser().parse_args(argv)) == 0
    timings = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["timings"]
    assert set(timings) == {"queue_time_s", "prefill_time_s", "decode_time_s", "time_to_first_token_s",
                            "num_preemptions", "cached_prompt_tokens", "replica"}
    assert timings["replica"] == "tiny@tpserve-0" and timings["num_preemptions"] == 0
    assert timings["decode_time_s"] >= 0.005  # 3 decode steps of 2 ms after the first token
    assert timings["time_to_first_token_s"] == pytest.approx(timings["queue_time_s"] + timings["prefill_time_s"])
