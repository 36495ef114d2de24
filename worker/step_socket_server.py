"""The rank's end of the step socket (tpserve/step_socket.py): the coordinator of its own host
writes plans there, and the one thread that runs this rank's steps reads them, executes them and
answers, with no gRPC thread in between.

One connection at a time: the thread that accepts them runs each one's steps, so a second
connection waits in the listen queue until the first ends (steps never run on two threads). A
connection ends when the coordinator closes it (a restart of the group, a shutdown) or a step
fails: its answer is written, the rank's ``on_fatal`` runs, and the connection is closed.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import structlog

from tpserve.step_socket import frame, frame_length, parse_hello
from tpserve.v1 import worker_pb2 as pb

log = structlog.get_logger(__name__)


class StepSocketServer:
    """Serves ``servicer.run_plan`` on the Unix socket ``path``.

    Args:
        servicer: the rank's WorkerServicer (``run_plan``, ``bind_step_thread``).
        path: the socket file; an old one is replaced.
        secret: the group's cluster secret, required in the hello (None: none configured).

    Raises:
        OSError: the socket cannot be bound.
    """

    def __init__(self, servicer, path: str, secret: str | None) -> None:
        self._servicer = servicer
        self._secret = secret
        self.path = path
        if os.path.exists(path):
            os.unlink(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(2)
        self._thread = threading.Thread(target=self._serve, name="step-socket", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops accepting; a connection in use ends with the process."""
        try:
            self._listener.close()
            os.unlink(self.path)
        except OSError:
            pass

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                self._run(conn)
            except (OSError, ValueError) as exc:  # PermissionError is an OSError
                log.warning("step connection ended", reason=f"{type(exc).__name__}: {exc}")
            finally:
                conn.close()

    def _run(self, conn: socket.socket) -> None:
        """One connection: the hello, then plan after plan until the coordinator closes it or a step fails."""
        self._servicer.bind_step_thread()  # once loaded: its CUDA device
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024**2)
        hello = _read_frame(conn)
        if hello is None:
            return
        answer_all = parse_hello(hello, self._secret)
        sent = None
        while True:
            payload = _read_frame(conn)
            if payload is None:
                return  # the coordinator closed the connection
            msg = pb.StepPlan.FromString(payload)
            result, failed = self._servicer.run_plan(msg, answer_all, sent)
            if result is not None:
                conn.sendall(frame(result.SerializeToString()))
            if failed:
                return
            sent = time.perf_counter()


def _read_frame(conn: socket.socket) -> bytes | None:
    """The next frame's payload, or None at the end of the stream (between frames).

    Raises:
        ConnectionError: the stream ended inside a frame.
        ValueError: a frame over the size limit.
    """
    header = _read_exactly(conn, 4)
    if header is None:
        return None
    length = frame_length(header)
    payload = _read_exactly(conn, length)
    if payload is None:
        raise ConnectionError("the step connection ended inside a frame")
    return payload


def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
    if size == 0:
        return b""
    chunk = conn.recv(size)
    if not chunk:
        return None
    if len(chunk) == size:
        return chunk
    buf = bytearray(chunk)
    while len(buf) < size:
        more = conn.recv(size - len(buf))
        if not more:
            raise ConnectionError("the step connection ended inside a frame")
        buf += more
    return bytes(buf)
