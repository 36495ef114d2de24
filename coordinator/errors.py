"""Errors that carry their gRPC status code, and the one interceptor that maps them.

Code deep in the coordinator raises a plain exception naming what went wrong; the
interceptor turns it into the status code of ARCHITECTURE.md's table at the edge.
Anything else that escapes a handler is a bug: INTERNAL, with the request id.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from coordinator.pushback import NO_RETRY_PUSHBACK_MS, PUSHBACK_KEY
from coordinator.wire_utf8 import invalid_utf8_field

log = structlog.get_logger(__name__)


class TpserveError(Exception):
    """Base class: an error the client should see with ``code`` and this message."""

    code = grpc.StatusCode.INTERNAL
    #: Sent with the status (a moved stream's KV hand-off: coordinator/kv_transfer/stream_moves.py).
    trailing_metadata: tuple[tuple[str, str], ...] = ()


class InvalidArgumentError(TpserveError, ValueError):
    """A request field is out of range; the message names the field and the limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class PermissionDeniedError(TpserveError):
    """The caller's key lacks the role the call needs; the message names the role."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFoundError(TpserveError):
    """The request names something the server does not serve (a LoRA adapter); the message names it."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(TpserveError):
    """The request would create something that exists already (a LoRA adapter's name)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(TpserveError):
    """The server is not in a state that allows the call (an adapter still in use, LoRA off)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(TpserveError):
    """The queue is full, or the request can never fit in the KV cache.

    Args:
        message: what the client sees.
        retry_pushback_ms: the wait, in milliseconds, sent to the client as ``grpc-retry-pushback-ms``
            (coordinator/pushback.py); None (a condition no retry cures) sends -1: do not retry.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_pushback_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_pushback_ms = retry_pushback_ms


class UnavailableError(TpserveError):
    """Not ready yet, draining, or the worker group is down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(TpserveError):
    """The client's deadline passed before the request finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


#: Methods whose errors this interceptor maps: ours and the engine protocol's (coordinator/vllm_engine_service.py).
_OWN_METHODS = ("/tpserve.", "/vllm.grpc.engine.")
#: Largest request message the API decodes (4 MiB, gRPC's usual default). Every valid
#: request is far smaller (prompt text at most 1 MiB, coordinator/validation.py); a
#: larger one gets INVALID_ARGUMENT naming this limit. The server's transport limit
#: (``grpc.max_receive_message_length``, launch/public_server.py) is set above it, so that
#: a request between the two gets this answer, not the transport's RESOURCE_EXHAUSTED
#: (which the API reserves for a full queue, a condition clients may retry).
MAX_REQUEST_BYTES = 4 * 1024**2
#: The transport's own limit: beyond it gRPC refuses the message with RESOURCE_EXHAUSTED
#: before any handler runs. It bounds the memory one request can take.
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024**2


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """What the safe deserializer returns for bytes that are not a valid request."""

    reason: str


def _safe_deserializer(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    """Wraps a request deserializer so that bad bytes become :class:`_Undecodable`, not an exception.

    gRPC answers a deserializer's exception with UNKNOWN and logs a traceback; the
    handler answers ``_Undecodable`` with INVALID_ARGUMENT and one log line.
    """

    def wrapped(data: bytes) -> Any:
        if len(data) > MAX_REQUEST_BYTES:
            return _Undecodable(f"the request is {len(data)} bytes; the limit is {MAX_REQUEST_BYTES} bytes "
                                "(a text prompt may have at most 1048576 bytes of UTF-8)")
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, invalid UTF-8 in a string field
            where = ""
            descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)  # FromString's class
            if "UTF-8" in str(exc) and descriptor is not None:
                field = invalid_utf8_field(descriptor, data)
                where = f"; field {field} is not valid UTF-8 (proto3 strings must be)" if field else ""
            return _Undecodable(f"the request does not decode as {method}'s request message: "
                                f"{type(exc).__name__}: {exc}{where}")

    return wrapped


async def _refuse_undecodable(context: grpc.aio.ServicerContext, method: str, request: _Undecodable,
                              errors: ErrorCount | None) -> None:
    log.warning("malformed request", method=method, error=request.reason)
    if errors is not None:
        errors.count(method, grpc.StatusCode.INVALID_ARGUMENT)
    await _end_call(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)


class ErrorCount:
    """Counts the RPCs of our services that end with a status other than OK (``tpserve:rpc_errors_total{method,
    code}``), and logs each one but a cancel (a warning per status code, rate-limited as every warning is:
    tpserve/log.py), with the request id and, but for INVALID_ARGUMENT (whose text may quote a request's
    content), the status's text. A shedding replica's refusals (RESOURCE_EXHAUSTED) and bad requests showed
    in no metric and no log line.

    Args:
        counter: the labelled counter (coordinator/metrics.py ``rpc_errors``).
    """

    def __init__(self, counter: Any) -> None:
        self.counter = counter

    def count(self, method: str, code: grpc.StatusCode, request_id: str = "", details: str = "") -> None:
        self.counter.labels(method=method, code=code.name).inc()
        if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL):
            return  # a client's own cancel; an internal error has its own line, with its traceback
        fields = {} if code is grpc.StatusCode.INVALID_ARGUMENT else {"details": details[:300]}
        log.warning(f"request refused: {code.name}", method=method, request_id=request_id, **fields)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping unary and server-streaming handlers to status codes.

    Also decodes requests itself: bytes that are not the method's request message, or
    more than MAX_REQUEST_BYTES of them, get INVALID_ARGUMENT (docs/design/faults.md, "Size caps, chosen together").
    ``errors``: where each status but OK is counted and logged (None: nowhere).
    """

    def __init__(self, errors: ErrorCount | None = None) -> None:
        self.errors = errors

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_OWN_METHODS):
            return handler  # health and reflection map their own errors
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await _refuse_undecodable(context, method, request, self.errors)
                    return  # the abort ended the call (gRPC ends it on the abort even if its status could not go out)
                try:
                    return await inner(request, context)
                except Exception as exc:  # noqa: BLE001 - mapped to a status here, once
                    request_id = getattr(request, "request_id", "")
                    del request  # this frame outlives the call in a cycle (_abort's docstring): not the request
                    await _abort(context, method, request_id, exc, self.errors)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, _safe_deserializer(handler.request_deserializer, method), handler.response_serializer)
        if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
            inner_writer = handler.unary_stream  # writes its messages itself (context.write)

            async def unary_stream_writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                if isinstance(request, _Undecodable):
                    await _refuse_undecodable(context, method, request, self.errors)
                    return  # the abort ended the call (gRPC ends it on the abort even if its status could not go out)
                try:
                    await inner_writer(request, context)
                except Exception as exc:  # noqa: BLE001 - mapped to a status here, once
                    request_id = getattr(request, "request_id", "")
                    del request  # this frame outlives the call in a cycle (_abort's docstring): not the request
                    await _abort(context, method, request_id, exc, self.errors)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream_writer, _safe_deserializer(handler.request_deserializer, method),
                handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await _refuse_undecodable(context, method, request, self.errors)
                    return  # the abort ended the call (gRPC ends it on the abort even if its status could not go out)
                try:
                    async for response in inner_stream(request, context):
                        yield response
                except Exception as exc:  # noqa: BLE001 - mapped to a status here, once
                    request_id = getattr(request, "request_id", "")
                    del request  # this frame outlives the call in a cycle (_abort's docstring): not the request
                    await _abort(context, method, request_id, exc, self.errors)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, _safe_deserializer(handler.request_deserializer, method), handler.response_serializer)
        return handler


async def _abort(context: grpc.aio.ServicerContext, method: str, request_id: str, exc: Exception,
                 errors: ErrorCount | None = None) -> None:
    """Ends the call with ``exc``'s status (ARCHITECTURE.md's table); INTERNAL, logged, for anything unmapped.

    gRPC's ``context.abort`` raises an AbortError, here inside the handler's ``except``: its context is
    ``exc``, its traceback holds these frames and the handler's (whose ``context`` holds the call's state,
    which holds the AbortError): a reference cycle, freed only by the cyclic collector, which the
    server runs every 50,000 allocations (coordinator/gc_policy.py) while a refused request makes about
    80. So ``exc`` loses its traceback here (after it is logged), and the frames in the cycle hold no
    request: the frames of the code that raised it held the request's prompt (a 100,000-token prompt
    refused as too long kept its ids list, about 3 MB, until a collection: 4.7 MB per refusal, without bound).
    """
    if isinstance(exc, grpc.aio.InternalError):
        # A write or an abort failed: the call had ended under the handler (its deadline passed in gRPC's
        # core, or the client left). Record an abort, so that gRPC ends the call quietly (_end_call).
        ended = grpc.StatusCode.DEADLINE_EXCEEDED if (context.time_remaining() or 1.0) <= 0 else grpc.StatusCode.CANCELLED
        if errors is not None:
            errors.count(method, ended, request_id, "the call ended before its response was sent")
        exc.__traceback__ = None
        try:
            await _end_call(context, ended, "the call ended before its response was sent")
        except grpc.aio.UsageError:
            pass  # the handler's own abort failed; gRPC ends the call on that one
        return
    # context.abort raises an exception of grpc's own to end the call: let it through.
    if type(exc).__module__.startswith("grpc"):
        raise exc
    if errors is not None:
        errors.count(method, exc.code if isinstance(exc, TpserveError) else grpc.StatusCode.INTERNAL, request_id,
                     str(exc))
    if isinstance(exc, TpserveError):
        exc.__traceback__ = None  # its frames held the request (the docstring); an unmapped one is logged first
    if isinstance(exc, ResourceExhaustedError):  # server pushback, read by the client's retry policy
        pushback = NO_RETRY_PUSHBACK_MS if exc.retry_pushback_ms is None else exc.retry_pushback_ms
        await _end_call(context, exc.code, str(exc),
                        (*(context.trailing_metadata() or ()), (PUSHBACK_KEY, str(pushback))))
    elif isinstance(exc, TpserveError):
        await _end_call(context, exc.code, str(exc), exc.trailing_metadata)
    else:
        request_id = request_id or f"unnamed-{uuid.uuid4().hex[:8]}"
        log.exception("internal error", method=method, request_id=request_id)
        exc.__traceback__ = None
        await _end_call(context, grpc.StatusCode.INTERNAL,
                        f"internal error in request {request_id}: {type(exc).__name__}: {exc}")


async def _end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str,
                    trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
    """``context.abort(code, details, trailing_metadata)``, which raises gRPC's AbortError to end the handler.

    A handler may finish in the instant its call ends under it: the client's deadline passes in gRPC's core
    as the engine's own deadline timer fires (both are the same deadline), or the client leaves. The status
    can then not be sent: abort raises ExecuteBatchError (a ``grpc.aio.InternalError``), which gRPC logs as an
    error with a traceback unless it has already seen the client close. abort records itself before it
    sends, and gRPC ends the call on that record when the handler returns (the server's
    ``raise_for_termination``), so that failure is only logged at debug level here and the handler returns.
    """
    try:
        await context.abort(code, details, trailing_metadata)
    except grpc.aio.InternalError as exc:
        log.debug("status not sent: the call had ended", code=code.name, details=details, error=str(exc))
