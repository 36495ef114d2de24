"""Bytes that are not a request get INVALID_ARGUMENT and one log line, not UNKNOWN and a traceback
(docs/design/faults.md, "Requests decode in the interceptor").

An in-process gRPC server with the real interceptor and servicer (no engine: a
well-formed request gets UNAVAILABLE, "loading"); the live-server cases are in
tests/e2e/test_public_faults.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.errors import ErrorInterceptor
from coordinator.server import GenerationServicer
from coordinator.tokenizer import Tokenizer
from tpserve.embedded_model import default_model_dir
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

INVALID_UTF8_TEXT = b"\x12\x03\xff\xfe\xfd"  # field 2 (text), 3 bytes that are not UTF-8


async def _call(raw: bytes) -> tuple[grpc.StatusCode, str]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    servicer = GenerationServicer(None, Tokenizer.from_pretrained(default_model_dir()), pb.ModelInfo())
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/tpserve.v1.Generation/Generate", request_serializer=None,
                                       response_deserializer=None)
            try:
                await call(raw, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""
    finally:
        await server.stop(None)


def test_invalid_utf8_gets_invalid_argument_logged_as_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    code, details = asyncio.run(_call(INVALID_UTF8_TEXT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode as /tpserve.v1.Generation/Generate's request message" in details
    assert details.endswith("field text is not valid UTF-8 (proto3 strings must be)")
    out, err = capfd.readouterr()
    logged = [line for line in (out + err).splitlines() if "malformed request" in line]
    assert len(logged) == 1, out + err
    assert "Traceback" not in out + err


def test_a_well_formed_request_still_reaches_the_handler() -> None:
    code, details = asyncio.run(_call(pb.GenerateRequest(text="Hi").SerializeToString()))
    assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details


@pytest.mark.parametrize("message, path", [
    (pb.GenerateRequest(text="ok", sampling_params=pb.SamplingParams(stop=["fine", "BAD"])), "sampling_params.stop"),
    (pb.GenerateRequest(request_id="BAD", text="ok"), "request_id"),
    (pb.GenerateRequest(text="ok", sampling_params=pb.SamplingParams(response_format=pb.ResponseFormat(regex="BAD"))),
     "sampling_params.response_format.regex"),
])
def test_the_field_with_bad_utf8_is_named(message: pb.GenerateRequest, path: str) -> None:
    from coordinator.wire_utf8 import invalid_utf8_field

    raw = message.SerializeToString().replace(b"BAD", b"B\xffD")  # same length: the wire format stays valid
    with pytest.raises(Exception, match="UTF-8"):
        pb.GenerateRequest.FromString(raw)
    assert invalid_utf8_field(pb.GenerateRequest.DESCRIPTOR, raw) == path
    assert invalid_utf8_field(pb.GenerateRequest.DESCRIPTOR, message.SerializeToString()) is None
    assert invalid_utf8_field(pb.GenerateRequest.DESCRIPTOR, b"\xff\xff\xff") is None  # not wire format
