"""The iterators of a GenerateStream call: blocking (:class:`GenerateStream`) and asyncio
(:class:`AsyncGenerateStream`). Both hand over :class:`tpserve.results.StreamChunk` s and, when the call
breaks, take the same move step (:meth:`_MovingStream._move`, :mod:`tpserve.stream_move`): they differ
only in how they wait for the next message and for the backoff.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from tpserve.client_calls import remaining_s
from tpserve.results import StreamChunk, chunk_of
from tpserve.stream_move import StreamMover
from tpserve.v1 import generate_pb2 as pb


class _MovingStream:
    """The state both iterators share: the current attempt's call, the mover and the deadline."""

    def __init__(self, call: Any, mover: StreamMover | None = None,
                 start: Callable[[pb.GenerateRequest, float | None], Any] | None = None,
                 deadline: float | None = None) -> None:
        self._call = call
        self._mover = mover
        self._start = start  # (request, timeout_s) -> a new call, for a move
        self._deadline = deadline
        self._moved_request: pb.GenerateRequest | None = None

    def _move(self, exc: grpc.RpcError) -> float:
        """The backoff in seconds before :meth:`_restart`; raises ``exc`` when the stream cannot move."""
        if self._mover is None:
            raise exc
        self._moved_request, backoff_s = self._mover.next_request(exc)
        self._between_attempts = True
        return backoff_s

    def _restart(self) -> None:
        """Starts the moved request's attempt, with what is left of the deadline; a stream its caller cancelled
        meanwhile (during the backoff, when no call runs to cancel) ends instead, with CANCELLED."""
        assert self._start is not None and self._moved_request is not None  # set by _move
        if self._cancelled_by_caller:
            raise _cancelled("cancelled while the stream was moving to another replica")
        if self._aborted:
            raise _cancelled("aborted (abort) while the stream was moving to another replica")
        self._call = self._start(self._moved_request, remaining_s(self._deadline))
        self._between_attempts = False

    _cancelled_by_caller = False
    _aborted = False
    _between_attempts = False  # a failed attempt's backoff: no call runs, the next starts after it

    def abort_if_moving(self, request_ids: frozenset[str]) -> bool:
        """The client's ``abort`` of ``request_ids``: a stream of one of them between two attempts of a move (no
        replica runs it, so no server's abort reaches it) starts no continuation; returns whether it was one."""
        if not (self._between_attempts and self._mover is not None and self._mover.request.request_id in request_ids):
            return False
        self._aborted = True
        return True

    def cancel(self) -> bool:
        """Cancels the RPC (the server frees the request's KV blocks); the reading loop raises ``grpc.RpcError``
        CANCELLED. Between two attempts of a moving stream it keeps the next from starting (the lost
        window: the continuation started after the cancel and ran to its end). Returns whether anything
        was cancelled (False: the stream had ended)."""
        self._cancelled_by_caller = True
        return self._call.cancel() or self._between_attempts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class GenerateStream(_MovingStream):
    """The :class:`StreamChunk` s of a ``GenerateStream`` call, in order. ``cancel()`` cancels the RPC (the
    server frees the request's KV blocks); the call's other methods (``code()``, ``details()``, ...)
    are reachable here too (on the current attempt's call, after a move). Iterating raises
    ``grpc.RpcError`` if the call fails and cannot move to another replica (:mod:`tpserve.stream_move`)."""

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        while True:
            try:
                message = next(self._call)
            except grpc.RpcError as exc:
                time.sleep(self._move(exc))
                self._restart()
                continue
            return chunk_of(self._mover.delivered(message) if self._mover else message)


def _cancelled(details: str) -> grpc.RpcError:
    """The error a cancelled stream's reader gets, as grpc's own for a call cancelled locally."""
    return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class AsyncGenerateStream(_MovingStream):
    """:class:`GenerateStream` for :class:`AsyncClient`: ``async for chunk in stream``.

    As with the blocking stream, leaving the loop early (``break``, an exception in its body) cancels
    the RPC, and the server frees the request's blocks: grpc.aio keeps a call running while the
    stream object lives, so an abandoned request ran to ``max_tokens`` (a slot and its KV blocks held)
    until the client closed. ``cancel()`` makes the reading loop raise ``grpc.RpcError`` (CANCELLED),
    as the blocking stream's does, not grpc.aio's ``asyncio.CancelledError``, which ``except
    grpc.RpcError`` misses and asyncio reads as the task's own cancellation.
    """

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        finished = False
        try:
            while True:
                try:
                    async for response in self._call:
                        yield chunk_of(self._mover.delivered(response) if self._mover else response)
                    finished = True
                    return
                except grpc.RpcError as exc:
                    await asyncio.sleep(self._move(exc))
                    self._restart()
                except asyncio.CancelledError:
                    if not self._cancelled_by_caller:
                        raise  # the task's own cancellation (a timeout, a shutdown): asyncio's to handle
                    finished = True
                    raise _cancelled("Locally cancelled by application!") from None
        finally:
            if not finished:  # the loop was left early (break, an exception): end the request on the server
                self._call.cancel()

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._chunks()
