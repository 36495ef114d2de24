"""``tpserve serve --otlp-traces-endpoint`` end to end (docs/design/observability.md, "Request timings and tracing"):
a real server exports each
request's trace over OTLP/gRPC to a local receiver, under the caller's span (the client sends
its ``traceparent``), and the stream's last message carries the timings and the replica.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from tests.e2e.cluster import serve

pytestmark = pytest.mark.e2e


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent, with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_serve_exports_each_request_as_a_trace_under_the_callers_span(monkeypatch, tmp_path) -> None:
    receiver = Receiver()
    collector = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    collector_port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the batch processor's export interval, ms
    monkeypatch.setenv("POD_NAME", "tpserve-e2e-0")
    try:
        log = tmp_path / "serve.log"
        with serve(None, 1, "--otlp-traces-endpoint", f"http://127.0.0.1:{collector_port}", log_path=log) as cluster:
            with TracerProvider().get_tracer("caller").start_as_current_span("caller") as caller:
                chunks = list(cluster.client.generate_stream("Once upon a time", max_tokens=8, temperature=0,
                                                             ignore_eos=True))
            deadline = time.monotonic() + 20
            while not any(span.name == "tpserve.request" for _, span in receiver.spans):
                assert time.monotonic() < deadline, "no request span reached the receiver"
                time.sleep(0.05)
    finally:
        collector.stop(None)
    # The one line that says what is on says where the spans go.
    (serving,) = [line for line in log.read_text(errors="replace").splitlines() if " serving " in line]
    assert f"otlp_traces_endpoint=http://127.0.0.1:{collector_port}" in serving, serving
    timings = chunks[-1].timings
    assert timings is not None and timings.replica.endswith("@tpserve-e2e-0")
    assert timings.decode_time_s > 0 and timings.prefill_time_s > 0
    context = caller.get_span_context()
    spans = {span.name: span for _, span in receiver.spans}
    assert {service for service, _ in receiver.spans} == {"tpserve"}
    root = spans["tpserve.request"]
    assert int.from_bytes(root.trace_id, "big") == context.trace_id
    assert int.from_bytes(root.parent_span_id, "big") == context.span_id
    for name in ("tpserve.queue", "tpserve.validate", "tpserve.prefill", "tpserve.decode"):
        assert int.from_bytes(spans[name].trace_id, "big") == context.trace_id, name
    assert spans["tpserve.validate"].parent_span_id == spans["tpserve.queue"].span_id
    assert spans["tpserve.queue"].parent_span_id == spans["tpserve.prefill"].parent_span_id == root.span_id
    assert spans["tpserve.queue"].end_time_unix_nano == spans["tpserve.prefill"].start_time_unix_nano
    assert spans["tpserve.prefill"].end_time_unix_nano == spans["tpserve.decode"].start_time_unix_nano
    duration_s = (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9
    assert duration_s == pytest.approx(timings.e2e_time_s, abs=1e-5)
    assert [event.name for event in root.events if event.name != "step"] == ["first_token", "finish"]
