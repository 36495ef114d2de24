"""The coordinator's end of a rank's step socket (tpserve/step_socket.py): the same three calls
as the gRPC ``Step`` stream it replaces on the coordinator's own host (``write``, ``read``,
``cancel``), so coordinator/worker_client.py drives both alike.

Semantics kept from grpc.aio's stream: ``read`` returns ``grpc.aio.EOF`` when the rank closed the
connection between messages; after ``cancel`` a read or write in flight, or a later one, raises
``asyncio.CancelledError``. A connection that breaks inside a frame raises ``ConnectionError``.
"""

from __future__ import annotations

import asyncio

import grpc

from tpserve.step_socket import frame, frame_length, hello
from tpserve.v1 import worker_pb2 as pb


class SocketStepStream:
    """One rank's step connection; open it with :meth:`open`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._cancelled = False

    @classmethod
    async def open(cls, path: str, errors_only: bool, secret: str | None) -> SocketStepStream:
        """Connects to the rank's step socket ``path`` and says hello.

        Raises:
            OSError: nothing listens at ``path`` (the rank is gone).
        """
        reader, writer = await asyncio.open_unix_connection(path, limit=2 * 1024**2)
        writer.write(frame(hello(errors_only, secret)))
        return cls(reader, writer)

    async def write(self, msg: pb.StepPlan) -> None:
        """Sends one plan (buffered by the transport; waits only while its buffer is full).

        Raises:
            asyncio.CancelledError: the stream was cancelled.
            ConnectionError: the connection is closed.
        """
        if self._cancelled:
            raise asyncio.CancelledError
        if self._writer.is_closing():
            raise ConnectionResetError("the step connection is closed")
        self._writer.write(frame(msg.SerializeToString()))
        if self._writer.transport.get_write_buffer_size() > 1024**2:
            await self._writer.drain()

    async def read(self) -> pb.StepResult:
        """The next answer, or ``grpc.aio.EOF`` when the rank closed the connection.

        Raises:
            asyncio.CancelledError: the stream was cancelled.
            ConnectionError: the connection broke inside an answer.
        """
        if self._cancelled:
            raise asyncio.CancelledError
        try:
            header = await self._reader.readexactly(4)
        except asyncio.IncompleteReadError as exc:
            if self._cancelled:
                raise asyncio.CancelledError from None
            if exc.partial:
                raise ConnectionResetError("the step connection ended inside an answer") from None
            return grpc.aio.EOF
        except ConnectionError:
            if self._cancelled:
                raise asyncio.CancelledError from None
            raise
        try:
            payload = await self._reader.readexactly(frame_length(header))
        except asyncio.IncompleteReadError:
            if self._cancelled:
                raise asyncio.CancelledError from None
            raise ConnectionResetError("the step connection ended inside an answer") from None
        return pb.StepResult.FromString(payload)

    def cancel(self) -> None:
        """Ends the stream: a read or write in flight raises CancelledError."""
        self._cancelled = True
        self._writer.close()
