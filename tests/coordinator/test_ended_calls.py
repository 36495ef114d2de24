"""A handler that finishes as its call ends under it (the client's deadline passing in gRPC's core as the
engine's own deadline timer fires) ends quietly: the status it can no longer send is not raised out of
the handler, where gRPC would log it as an error with a traceback (ExecuteBatchError raised in core by
servicer method ...). coordinator/errors.py's ErrorInterceptor, its handlers called with a context whose
sends fail as gRPC's do then; the status a live call gets is tested in tests/coordinator/test_malformed_requests.py
and tests/e2e/test_stories_serving.py (a passed deadline)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from coordinator.errors import DeadlineExceededError, ErrorInterceptor, InvalidArgumentError

METHOD = "/tpserve.v1.Generation/Generate"


class _SendFailed(grpc.aio.InternalError):
    """What gRPC raises when a batch of sends fails (its ExecuteBatchError is an InternalError too)."""


class EndedCallContext:
    """A servicer context whose call has ended: abort records itself, then its send fails, as gRPC's does."""

    def __init__(self, time_remaining: float | None) -> None:
        self._time_remaining = time_remaining
        self.aborts: list[tuple[grpc.StatusCode, str]] = []

    def time_remaining(self) -> float | None:
        return self._time_remaining

    def trailing_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        if self.aborts:
            raise grpc.aio.UsageError("Abort was already called!")
        self.aborts.append((code, details))
        raise _SendFailed('Failed "execute_batch": (SendStatusFromServerOperation,)')


def _wrapped(handler: Any, streaming: bool) -> Any:
    """``handler`` as the interceptor wraps it for ``METHOD``."""
    if streaming:
        method_handler = grpc.unary_stream_rpc_method_handler(handler)
    else:
        method_handler = grpc.unary_unary_rpc_method_handler(handler)

    async def continuation(details: Any) -> Any:
        return method_handler

    details = SimpleNamespace(method=METHOD, invocation_metadata=())
    wrapped = asyncio.run(ErrorInterceptor().intercept_service(continuation, details))  # type: ignore[arg-type]
    return wrapped.unary_stream if streaming else wrapped.unary_unary


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream-writer"])
def test_the_engine_s_deadline_as_the_call_ends_returns_quietly(streaming: bool) -> None:
    async def handler(request: Any, context: Any) -> None:
        raise DeadlineExceededError("request r1: deadline of 0.1 s exceeded")

    context = EndedCallContext(time_remaining=0.0)
    assert asyncio.run(_wrapped(handler, streaming)(object(), context)) is None  # nothing raised
    assert context.aborts == [(grpc.StatusCode.DEADLINE_EXCEEDED, "request r1: deadline of 0.1 s exceeded")]


@pytest.mark.parametrize(("time_remaining", "code"), [(-0.01, grpc.StatusCode.DEADLINE_EXCEEDED),
                                                      (None, grpc.StatusCode.CANCELLED)])
def test_a_write_that_fails_as_the_call_ends_records_why_and_returns(time_remaining: float | None,
                                                                     code: grpc.StatusCode) -> None:
    async def handler(request: Any, context: Any) -> None:
        raise _SendFailed('Failed "execute_batch": (SendMessageOperation,)')  # context.write's failure

    context = EndedCallContext(time_remaining)
    assert asyncio.run(_wrapped(handler, True)(object(), context)) is None
    assert context.aborts == [(code, "the call ended before its response was sent")]


def test_the_handler_s_own_failed_abort_is_not_aborted_twice() -> None:
    async def handler(request: Any, context: EndedCallContext) -> None:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such adapter")

    context = EndedCallContext(time_remaining=5.0)
    assert asyncio.run(_wrapped(handler, False)(object(), context)) is None
    assert context.aborts == [(grpc.StatusCode.NOT_FOUND, "no such adapter")]


def test_a_live_call_s_abort_still_ends_the_handler() -> None:
    """Where the status goes out, gRPC's AbortError ends the handler as before (the case above is the exception)."""

    class LiveContext(EndedCallContext):
        async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
            self.aborts.append((code, details))
            raise grpc.aio.AbortError("Locally aborted.")

    async def handler(request: Any, context: Any) -> None:
        raise InvalidArgumentError("max_tokens must be positive")

    context = LiveContext(time_remaining=5.0)
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(_wrapped(handler, False)(object(), context))
    assert context.aborts == [(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be positive")]
