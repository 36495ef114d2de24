"""OpenTelemetry traces of requests (``--otlp-traces-endpoint``, vLLM's flag), off by default.

Off, nothing here runs per step or per token: a handler checks :func:`enabled` once per
request and leaves ``RequestEntry.trace_context`` None, and the request's end checks that.
On, the caller's W3C trace context (the ``traceparent``/``tracestate`` gRPC metadata the
smg gateway and the tpserve client send) is taken at receipt, and when a sample ends
its spans are written at once from the instants the engine noted anyway
(coordinator/request_timeline.py), with their real start and end times:

    tpserve.request            received -> last output; events first_token, step, finish
      tpserve.queue            received -> first admitted
        tpserve.validate       received -> validated (tokenization, chat template, grammar compile)
        tpserve.grammar        rank 0 building a response_format's grammar (with one)
      tpserve.prefill          first admitted -> first token
      tpserve.prefill_chunk    one per prefill step: the previous chunk's end (or the admission) ->
                               its end, with the positions it computed (recomputes included)
      tpserve.preemption       preempted -> re-admitted (one per preemption)
      tpserve.decode           first token -> last output

Every :data:`STEP_SAMPLE_INTERVAL`-th engine step's timings (its duration, rank 0's execute
time, its tokens: what ``Metrics.observe_step`` records anyway) are kept while tracing is on
(:func:`sample_steps`) and become ``step`` events on the request spans of the requests that
were admitted when the step ended.

A stream moved to another replica (tpserve/stream_move.py) continues with the same
``traceparent``, so both replicas' request spans share one trace and one parent.

The SDK and the OTLP exporter are the ``tracing`` extra; they are imported only when
:func:`configure` is called. Attribute names follow vLLM's (``gen_ai.*``).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.metrics import Metrics
    from coordinator.request_output import RequestOutput
    from coordinator.request_table import RequestEntry
    from coordinator.request_timings import RequestTimings

INSTALL_HINT = "--otlp-traces-endpoint needs the tracing extra: pip install 'tpserve[tracing]'"

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_provider: Any = None
#: Every this many engine steps, one step's timings are kept for the request spans.
STEP_SAMPLE_INTERVAL = 16
#: The sampled steps, oldest first: (time.monotonic() at its end, tokens, duration s, rank 0's execute s).
_steps: deque[tuple[float, int, float, float]] = deque(maxlen=4096)


class TracingUnavailableError(RuntimeError):
    """The tracing extra (opentelemetry-sdk, the OTLP exporter) is not installed."""


def configure(endpoint: str | None, service_name: str, exporter: Any = None) -> None:
    """Turns tracing on: spans go to the OTLP/gRPC collector at ``endpoint`` (batched, on the
    SDK's thread), or to ``exporter`` (an SDK ``SpanExporter``, written at once: tests).

    Raises:
        TracingUnavailableError: the ``tracing`` extra is missing (message: :data:`INSTALL_HINT`).
    """
    global _tracer, _provider
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise TracingUnavailableError(INSTALL_HINT) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingUnavailableError(INSTALL_HINT) from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("tpserve")
    _steps.clear()


def shutdown() -> None:
    """Flushes the spans not exported yet and turns tracing off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def sample_steps(metrics: Metrics, every: int = STEP_SAMPLE_INTERVAL) -> None:
    """Keeps every ``every``-th step that ``metrics.observe_step`` records for the request spans
    (:func:`record_request`). Called once at start-up, only with tracing on: off, the step path
    is untouched."""
    observe = metrics.observe_step
    count = 0

    def observe_step(num_tokens: int, duration_s: float, model_execute_s: float, worker_wait_s: float | None,
                     received: float, done: float) -> None:
        nonlocal count
        observe(num_tokens, duration_s, model_execute_s, worker_wait_s, received, done)
        count += 1
        if count % every == 0:
            _steps.append((time.monotonic(), num_tokens, duration_s, model_execute_s))

    setattr(metrics, "observe_step", observe_step)  # noqa: B010 - an instance's method replaced


def enabled() -> bool:
    """Whether requests are traced."""
    return _tracer is not None


def extract(metadata: Iterable[tuple[str, Any]] | None) -> Any:
    """The trace context that gRPC ``metadata`` carries (W3C ``traceparent``, ``tracestate``);
    an empty context (a new trace) without one or with a malformed one. Only while tracing is on."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {key: value for key, value in metadata or () if key in ("traceparent", "tracestate")}
    return TraceContextTextMapPropagator().extract(carrier)


def record_request(entry: RequestEntry, output: RequestOutput, timings: RequestTimings, sample: object) -> None:
    """Writes the spans of ``entry``'s sample ``sample`` (the engine's state of it; None: one that
    never reached the queue), which ended with ``output``: see the module's docstring."""
    finish = output.finish_reason.value if output.finish_reason else ""
    _record(entry, timings, sample, finish, output.num_prompt_tokens, output.num_completion_tokens)


def record_failed(entry: RequestEntry, timings: RequestTimings, sample: object, prompt_tokens: int,
                  completion_tokens: int) -> None:
    """Writes the spans of a sample that ended without a last output (a deadline, a lost worker
    group, a cancel); its request span's status is ERROR. Once per sample: a sample already
    recorded is skipped."""
    _record(entry, timings, sample, "error", prompt_tokens, completion_tokens)


def _record(entry: RequestEntry, timings: RequestTimings, sample: object, finish: str, prompt_tokens: int,
            completion_tokens: int) -> None:
    from opentelemetry import trace

    tracer = _tracer
    if entry.traced_samples is None:
        entry.traced_samples = set()
    if tracer is None or id(sample) in entry.traced_samples:
        return
    entry.traced_samples.add(id(sample))
    to_ns = _clock_offset_ns()
    end = to_ns(timings.finished_s)
    attributes = {
        "gen_ai.request.id": entry.request_id,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": completion_tokens,
        "gen_ai.usage.cached_prompt_tokens": timings.cached_prompt_tokens,
        "gen_ai.latency.time_in_queue": timings.queue_time_s,
        "gen_ai.latency.time_to_first_token": timings.time_to_first_token_s,
        "gen_ai.latency.time_in_model_prefill": timings.prefill_time_s,
        "gen_ai.latency.time_in_model_decode": timings.decode_time_s,
        "gen_ai.latency.e2e": timings.e2e_time_s,
        "tpserve.num_preemptions": timings.num_preemptions,
        "tpserve.finish_reason": finish,
    }
    span = tracer.start_span("tpserve.request", context=entry.trace_context, start_time=to_ns(timings.received_s),
                             attributes=attributes, kind=trace.SpanKind.SERVER)
    child_context = trace.set_span_in_context(span)

    def child(name: str, start: float, stop: float, parent: Any = child_context, attributes: Any = None) -> Any:
        span = tracer.start_span(name, context=parent, start_time=to_ns(start), attributes=attributes)
        span.end(end_time=to_ns(stop))
        return span

    admitted = timings.admitted_s if timings.admitted_s is not None else timings.finished_s
    queue = child("tpserve.queue", timings.received_s, admitted)
    in_queue = trace.set_span_in_context(queue)
    if entry.validated_s is not None:  # tokenization, chat template, the coordinator's grammar compile
        child("tpserve.validate", timings.received_s, min(entry.validated_s, admitted), in_queue)
    if entry.grammar_s is not None:  # rank 0 building the grammar before the request is queued
        child("tpserve.grammar", entry.grammar_s[0], min(entry.grammar_s[1], admitted), in_queue)
    if timings.admitted_s is not None:
        child("tpserve.prefill", timings.admitted_s, timings.first_token_s or timings.finished_s)
    _add_chunk_spans(timings, child)
    for index, preempted in enumerate(timings.preempted_s):
        resumed = timings.resumed_s[index] if index < len(timings.resumed_s) else timings.finished_s
        child("tpserve.preemption", preempted, max(resumed, preempted))
    if timings.admitted_s is not None:
        _add_step_events(span, timings.admitted_s, timings.finished_s, to_ns)
    if timings.first_token_s is not None:
        span.add_event("first_token", timestamp=to_ns(timings.first_token_s))
        child("tpserve.decode", timings.first_token_s, timings.finished_s)
    span.add_event("finish", {"finish_reason": finish}, timestamp=end)
    if finish == "error":
        span.set_status(trace.StatusCode.ERROR, "ended without a last output (deadline, failure or cancel)")
    span.end(end_time=end)


def _add_chunk_spans(timings: RequestTimings, child: Any) -> None:
    """A ``tpserve.prefill_chunk`` span per prefill step of the sample: from the later of the
    previous chunk's end and the last admission before this chunk, to this chunk's end, with the
    prompt positions it computed (``tpserve.chunk.start``, ``tpserve.chunk.num_tokens``)."""
    admissions = [a for a in (timings.admitted_s, *timings.resumed_s) if a is not None]
    previous_end = None
    for end, start_position, end_position in timings.prefill_chunks:
        admitted = max((a for a in admissions if a <= end), default=end)
        start = admitted if previous_end is None else max(previous_end, admitted)
        child("tpserve.prefill_chunk", start, max(end, start),
              attributes={"tpserve.chunk.start": start_position,
                          "tpserve.chunk.num_tokens": end_position - start_position})
        previous_end = end


def _add_step_events(span: Any, start: float, stop: float, to_ns: Any) -> None:
    """A ``step`` event for each sampled step that ended in [start, stop] (monotonic seconds)."""
    steps = _steps
    index = bisect.bisect_left(steps, (start,))
    while index < len(steps) and steps[index][0] <= stop:
        ended, num_tokens, duration_s, execute_s = steps[index]
        span.add_event("step", {"tpserve.step.num_tokens": num_tokens, "tpserve.step.duration_s": duration_s,
                                "tpserve.step.model_execute_time_s": execute_s}, timestamp=to_ns(ended))
        index += 1


def _clock_offset_ns() -> Any:
    """A function from ``time.monotonic()`` seconds to the epoch nanoseconds spans are stamped in."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda monotonic_s: int(monotonic_s * 1e9) + offset
