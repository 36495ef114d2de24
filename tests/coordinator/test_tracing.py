"""OpenTelemetry traces of requests (docs/design/observability.md, "Request timings and tracing"): one trace per
request under the caller's
``traceparent``, children in order, sampled step events, preemptions, a moved stream in one trace, and the refusal
of ``--otlp-traces-endpoint`` without the tracing extra.

The spans go to the SDK's in-memory exporter (``tracing.configure(..., exporter=...)``); the
servers are in-process over a scripted worker group (tests/coordinator/test_request_timings.py).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator import tracing
from coordinator.errors import UnavailableError
from tests.coordinator.fakes import PROMPT
from tests.coordinator.timed_engine import make_engine, request, serving, timed_stream
from tests.e2e.cluster import free_port
from tests.paths import REPO_ROOT
from tpserve.client import AsyncClient
from tpserve.stream_move import MovePolicy

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def exporter():
    spans = InMemorySpanExporter()
    tracing.configure(None, "tpserve-test", exporter=spans)
    try:
        yield spans
    finally:
        tracing.shutdown()


def by_name(spans, name: str) -> list:
    return [span for span in spans if span.name == name]


def test_a_request_with_a_traceparent_is_one_trace_of_ordered_children(exporter) -> None:
    async def main():
        engine = make_engine(step_s=0.005)
        tracing.sample_steps(engine.metrics, every=2)  # as the leader does with tracing on (every 16th)
        async with serving(engine) as (stub, _):
            return await timed_stream(stub, request("r1", 6), metadata=(("traceparent", TRACEPARENT),))

    messages, _ = asyncio.run(main())
    timings = messages[-1].timings
    spans = exporter.get_finished_spans()
    assert {format(span.context.trace_id, "032x") for span in spans} == {TRACE_ID}  # one trace, the caller's
    (root,) = by_name(spans, "tpserve.request")
    assert format(root.parent.span_id, "016x") == PARENT_ID and root.parent.is_remote
    assert root.kind is trace.SpanKind.SERVER
    children = sorted((s for s in spans if s.parent.span_id == root.context.span_id), key=lambda s: s.start_time)
    (chunk,) = [s for s in children if s.name == "tpserve.prefill_chunk"]  # the prompt fits one step
    children.remove(chunk)
    assert [s.name for s in children] == ["tpserve.queue", "tpserve.prefill", "tpserve.decode"]
    queue, prefill, decode = children
    assert chunk.start_time == prefill.start_time and chunk.end_time <= prefill.end_time
    assert dict(chunk.attributes) == {"tpserve.chunk.start": 0, "tpserve.chunk.num_tokens": len(PROMPT)}
    (validate,) = [s for s in spans if s.parent.span_id == queue.context.span_id]
    assert validate.name == "tpserve.validate" and validate.start_time == queue.start_time
    assert validate.end_time <= queue.end_time and len(spans) == 6
    assert root.start_time == queue.start_time and queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time and decode.end_time == root.end_time
    first_token, finish = (e for e in root.events if e.name != "step")
    assert (first_token.name, finish.name) == ("first_token", "finish")
    assert first_token.timestamp == prefill.end_time and finish.attributes["finish_reason"] == "length"
    steps = [e for e in root.events if e.name == "step"]  # 6 steps (one prefill, five decodes): every 2nd
    assert len(steps) == 3, [e.name for e in root.events]
    assert all(prefill.start_time <= e.timestamp <= root.end_time for e in steps)
    assert all(e.attributes["tpserve.step.num_tokens"] >= 1 and e.attributes["tpserve.step.duration_s"] > 0.004
               for e in steps)
    assert root.attributes["gen_ai.request.id"] == "r1"
    assert root.attributes["gen_ai.usage.completion_tokens"] == 6
    assert root.attributes["gen_ai.latency.time_in_queue"] == timings.queue_time_s
    assert root.attributes["gen_ai.latency.time_to_first_token"] == timings.time_to_first_token_s
    assert (root.end_time - root.start_time) / 1e9 == pytest.approx(
        timings.queue_time_s + timings.prefill_time_s + timings.decode_time_s, abs=2e-6)


def test_a_grammar_build_is_a_span_in_the_queue(exporter) -> None:
    """A response_format request: rank 0 builds its grammar (30 ms here) after validation (which
    compiled it on the coordinator) and before the queue ends: both are children of the queue span."""
    async def main():
        async with serving(make_engine(step_s=0.002, grammar_s=0.030)) as (stub, _):
            req = request("g", 3)
            req.sampling_params.ignore_eos = False  # refused with a grammar
            req.sampling_params.response_format.choices.choices.extend(["yes", "no"])
            await stub.Generate(req)

    asyncio.run(main())
    spans = exporter.get_finished_spans()
    (queue,) = by_name(spans, "tpserve.queue")
    (validate,) = by_name(spans, "tpserve.validate")
    (grammar,) = by_name(spans, "tpserve.grammar")
    assert validate.parent.span_id == queue.context.span_id == grammar.parent.span_id
    assert queue.start_time == validate.start_time <= validate.end_time <= grammar.start_time
    assert grammar.end_time <= queue.end_time
    assert grammar.end_time - grammar.start_time >= 29_000_000  # ns


def test_a_request_without_a_traceparent_starts_its_own_trace(exporter) -> None:
    async def main():
        async with serving(make_engine(step_s=0.002)) as (stub, _):
            await stub.Generate(request("r1", 2))

    asyncio.run(main())
    (root,) = by_name(exporter.get_finished_spans(), "tpserve.request")
    assert root.parent is None


def test_preemptions_are_child_spans(exporter) -> None:
    """Two requests that cannot both finish in 12 blocks: a preemption span per preemption,
    between its request's queue and end."""
    async def main():
        engine = make_engine(num_blocks=12, step_s=0.002)
        async with serving(engine) as (stub, _):
            results = await asyncio.gather(stub.Generate(request("a", 20)), stub.Generate(request("b", 20)))
        return results, engine.scheduler.num_preemptions

    results, num_preemptions = asyncio.run(main())
    spans = exporter.get_finished_spans()
    preemptions = by_name(spans, "tpserve.preemption")
    assert num_preemptions >= 1 and len(preemptions) == num_preemptions
    roots = {span.context.span_id: span for span in by_name(spans, "tpserve.request")}
    for span in preemptions:
        root = roots[span.parent.span_id]
        assert root.start_time < span.start_time <= span.end_time <= root.end_time
        assert root.attributes["tpserve.num_preemptions"] >= 1


def test_a_moved_stream_stays_in_the_callers_trace(exporter) -> None:
    """The replica serving a stream loses its group after 3 tokens (UNAVAILABLE): the client
    continues on the other replica with the same traceparent, so both replicas' request spans
    are children of the caller's span, the first one failed."""
    async def main():
        first, second = make_engine(step_s=0.005), make_engine(step_s=0.005)
        async with serving(first) as (_, port1), serving(second) as (_, port2):
            tracer = TracerProvider().get_tracer("caller")
            with tracer.start_as_current_span("caller") as caller:
                async with AsyncClient(f"ipv4:127.0.0.1:{port1},127.0.0.1:{port2}",
                                       move_policy=MovePolicy(initial_backoff_s=0.01)) as client:
                    tokens, last = [], None
                    async for chunk in client.generate_stream(list(request("m", 12).token_ids.ids), max_tokens=12,
                                                              temperature=0, ignore_eos=True):
                        tokens.extend(chunk.token_ids)
                        last = chunk
                        if len(tokens) == 3:
                            serving_engine = first if first.num_requests else second
                            serving_engine.fail_all("the worker group failed: rank 0 lost", UnavailableError)
            return caller.get_span_context(), tokens, last

    caller, tokens, last = asyncio.run(main())
    assert len(tokens) == 12 and last.finish_reason == "length"
    roots = sorted(by_name(exporter.get_finished_spans(), "tpserve.request"), key=lambda s: s.start_time)
    assert len(roots) == 2
    assert {span.context.trace_id for span in roots} == {caller.trace_id}
    assert {span.parent.span_id for span in roots} == {caller.span_id}
    assert roots[0].status.status_code is trace.StatusCode.ERROR
    assert roots[1].status.status_code is trace.StatusCode.UNSET
    assert roots[1].attributes["tpserve.finish_reason"] == "length"


def test_serve_without_the_tracing_extra_refuses_the_flag_in_one_line() -> None:
    """opentelemetry made unimportable: ``tpserve serve --otlp-traces-endpoint`` exits 2 with one line."""
    code = ("import sys; sys.modules['opentelemetry'] = None; from launch.cli import main; "
            f"sys.exit(main(['serve', '--port', '{free_port()}', '--otlp-traces-endpoint', 'http://127.0.0.1:4317']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith(tracing.INSTALL_HINT), out.stderr


def test_configure_without_the_extra_raises_the_install_hint(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(tracing.TracingUnavailableError, match=r"pip install 'tpserve\[tracing\]'"):
        tracing.configure("http://127.0.0.1:4317", "tpserve")
    assert not tracing.enabled()



def test_a_chunked_prefill_is_a_span_per_chunk(exporter) -> None:
    """A prompt longer than the step's token budget (256) is computed in chunks: one span each, in
    order, back to back, covering the prompt's positions once."""
    prompt = [(7 * i) % 500 + 3 for i in range(600)]

    async def main():
        engine = make_engine(step_s=0.002)
        async with serving(engine) as (stub, _):
            return await timed_stream(stub, request("long", 3, prompt), metadata=(("traceparent", TRACEPARENT),))

    asyncio.run(main())
    spans = exporter.get_finished_spans()
    (root,) = by_name(spans, "tpserve.request")
    (prefill,) = by_name(spans, "tpserve.prefill")
    chunks = sorted(by_name(spans, "tpserve.prefill_chunk"), key=lambda s: s.start_time)
    assert [(c.attributes["tpserve.chunk.start"], c.attributes["tpserve.chunk.num_tokens"]) for c in chunks] == \
        [(0, 256), (256, 256), (512, 88)]
    assert all(c.parent.span_id == root.context.span_id for c in chunks)
    assert chunks[0].start_time == prefill.start_time and chunks[-1].end_time <= prefill.end_time
    assert all(a.end_time == b.start_time for a, b in zip(chunks, chunks[1:]))  # back to back


def test_the_design_notes_leave_out_no_span_this_module_writes() -> None:
    """observability.md's "Left out" bullets name no span of the module's tree: one said the per-chunk spans were
    left out, below the bullet that describes them."""
    spans = re.findall(r"^\s+tpserve\.(\w+)\s", tracing.__doc__ or "", re.M)
    notes = (REPO_ROOT / "docs" / "design" / "observability.md").read_text()
    left_out = " ".join(" ".join(bullet.split()) for bullet in
                        re.findall(r"^- \*\*Left out\.?\*\*(.+?)(?=^- |^#|\Z)", notes, re.M | re.S))
    assert "prefill_chunk" in spans
    assert [span for span in spans if f"span per {span.replace('_', ' ')}" in left_out] == []
