"""The step socket between the coordinator and the ranks of its host (tpserve/step_socket.py):
the rank's end (worker/step_socket_server.py) and the coordinator's (coordinator/step_socket_stream.py)
over a real Unix socket, with a stand-in for the rank's servicer; and a group that fails at once
when a watched rank reports a failed step through it."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from coordinator.step_socket_stream import SocketStepStream
from coordinator.worker_client import WorkerGroup, WorkerGroupError
from tpserve.step import StepPlan
from tpserve.step_socket import MAX_FRAME_BYTES, frame, frame_length, hello, parse_hello, socket_path
from tpserve.v1 import worker_pb2 as pb
from worker.step_socket_server import StepSocketServer

FAIL_STEP = 99


class FakeServicer:
    """Answers step N with the token 10 * N; step FAIL_STEP fails. ``hold`` blocks every step until set."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.threads: set[str] = set()
        self.steps: list[int] = []
        self.hold = hold

    def bind_step_thread(self) -> None:
        pass

    def run_plan(self, msg: pb.StepPlan, answer_all: bool, sent: float | None):
        self.threads.add(threading.current_thread().name)
        self.steps.append(msg.step_id)
        if self.hold is not None:
            self.hold.wait(10)
        if msg.step_id == FAIL_STEP:
            return pb.StepResult(step_id=msg.step_id, error=f"rank 1: step {msg.step_id} failed: boom"), True
        if not answer_all:
            return None, False
        return pb.StepResult(step_id=msg.step_id, sampled_token_ids=[10 * msg.step_id]), False


@pytest.fixture
def rank(tmp_path):
    """``rank(servicer, secret=None)``: a started StepSocketServer; its socket path."""
    servers = []

    def start(servicer, secret=None) -> str:
        server = StepSocketServer(servicer, str(tmp_path / f"rank{len(servers)}.sock.step"), secret)
        server.start()
        servers.append(server)
        return server.path

    yield start
    for server in servers:
        server.close()


def test_a_unix_rank_gets_a_step_socket_and_a_tcp_rank_keeps_grpc() -> None:
    assert socket_path("unix:///tmp/tpserve-ranks-x/rank0-1.sock") == "/tmp/tpserve-ranks-x/rank0-1.sock.step"
    assert socket_path("unix:/tmp/r.sock") == "/tmp/r.sock.step"
    assert socket_path("10.0.0.7:29502") is None and socket_path("ipv4:10.0.0.7:29502") is None


def test_the_hello_names_the_mode_and_carries_the_secret() -> None:
    assert parse_hello(hello(False, None), None) is True
    assert parse_hello(hello(True, "s3cret"), "s3cret") is False
    with pytest.raises(PermissionError, match="cluster secret"):
        parse_hello(hello(False, "wrong"), "s3cret")
    with pytest.raises(PermissionError, match="not a tpserve step connection"):
        parse_hello(b"hello", None)
    with pytest.raises(PermissionError, match="not a tpserve-step/1 connection"):
        parse_hello(b"GET / HTTP/1.1", None)
    assert frame_length(frame(b"abc")[:4]) == 3
    with pytest.raises(ValueError, match="over the"):
        frame_length((MAX_FRAME_BYTES + 1).to_bytes(4, "little"))


def test_plans_written_ahead_are_answered_in_order_on_one_thread(rank) -> None:
    servicer = FakeServicer()
    path = rank(servicer)

    async def main():
        stream = await SocketStepStream.open(path, errors_only=False, secret=None)
        for step_id in (1, 2, 3):  # written before any answer is read, as async scheduling does
            await stream.write(pb.StepPlan(step_id=step_id))
        answers = [await stream.read() for _ in range(3)]
        stream.cancel()
        return answers

    answers = asyncio.run(main())
    assert [(a.step_id, list(a.sampled_token_ids)) for a in answers] == [(1, [10]), (2, [20]), (3, [30])]
    assert servicer.threads == {"step-socket"}


def test_an_errors_only_connection_answers_the_failed_step_then_ends(rank) -> None:
    servicer = FakeServicer()
    path = rank(servicer)

    async def main():
        stream = await SocketStepStream.open(path, errors_only=True, secret=None)
        for step_id in (1, 2, FAIL_STEP):
            await stream.write(pb.StepPlan(step_id=step_id))
        first = await asyncio.wait_for(stream.read(), 5)
        after = await asyncio.wait_for(stream.read(), 5)
        stream.cancel()
        return first, after

    first, after = asyncio.run(main())
    assert first.step_id == FAIL_STEP and "boom" in first.error
    assert after is grpc.aio.EOF
    assert servicer.steps == [1, 2, FAIL_STEP]


def test_a_connection_without_the_secret_runs_nothing(rank) -> None:
    servicer = FakeServicer()
    path = rank(servicer, secret="s3cret")

    async def main():
        stream = await SocketStepStream.open(path, errors_only=False, secret="guess")
        await stream.write(pb.StepPlan(step_id=1))
        try:  # the rank closes it: at once (EOF) or over the unread plan (a reset)
            answer = await asyncio.wait_for(stream.read(), 5)
        except ConnectionError:
            answer = grpc.aio.EOF
        stream.cancel()
        ok = await SocketStepStream.open(path, errors_only=False, secret="s3cret")  # the rank serves the next one
        await ok.write(pb.StepPlan(step_id=2))
        good = await asyncio.wait_for(ok.read(), 5)
        ok.cancel()
        return answer, good

    answer, good = asyncio.run(main())
    assert answer is grpc.aio.EOF and good.step_id == 2
    assert servicer.steps == [2]


def test_cancel_ends_a_read_in_flight_and_later_writes(rank) -> None:
    hold = threading.Event()
    path = rank(FakeServicer(hold))

    async def main():
        stream = await SocketStepStream.open(path, errors_only=False, secret=None)
        await stream.write(pb.StepPlan(step_id=1))
        reading = asyncio.ensure_future(stream.read())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        with pytest.raises(asyncio.CancelledError):
            await stream.write(pb.StepPlan(step_id=2))
        return time.monotonic() - started

    try:
        assert asyncio.run(main()) < 1.0
    finally:
        hold.set()


def test_a_connection_that_breaks_inside_an_answer_raises(tmp_path) -> None:
    path = str(tmp_path / "half.step")

    async def main():
        async def half_answer(reader, writer):
            await reader.read(100)
            writer.write(frame(b"\x08\x01" * 10)[:7])  # a header and three bytes of twenty
            await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(half_answer, path)
        async with server:
            stream = await SocketStepStream.open(path, errors_only=False, secret=None)
            await stream.write(pb.StepPlan(step_id=1))
            with pytest.raises(ConnectionError, match="inside an answer"):
                await asyncio.wait_for(stream.read(), 5)

    asyncio.run(main())


def test_a_watched_rank_failing_on_its_socket_fails_the_step_at_once(rank) -> None:
    """Rank 0 (the sampling rank) blocks in its step, as a rank in a collective waits for a failed
    peer; rank 1 answers only failures and fails: the step fails with rank 1's error within 1 s."""
    hold = threading.Event()
    sampling, watched = rank(FakeServicer(hold)), rank(FakeServicer())

    async def main():
        group = WorkerGroup(["unix:///nonexistent/rank0.sock", "unix:///nonexistent/rank1.sock"], 60.0)
        group._attach([await SocketStepStream.open(sampling, errors_only=False, secret=None),
                       await SocketStepStream.open(watched, errors_only=True, secret=None)])
        started = time.monotonic()
        try:
            with pytest.raises(WorkerGroupError) as failure:
                await group.execute(StepPlan(step_id=FAIL_STEP))
            return str(failure.value), time.monotonic() - started
        finally:
            await group.close()

    try:
        reason, elapsed = asyncio.run(main())
    finally:
        hold.set()
    assert "rank 1: step 99 failed: boom" in reason and elapsed < 1.0


def test_a_rank_whose_step_socket_does_not_answer_steps_over_its_grpc_stream(tmp_path) -> None:
    """A rank that could not bind its step socket (worker/main.py logs it) still serves: the group
    opens that rank's gRPC Step stream instead, errors-only for all but the sampling rank."""
    from tpserve.step_pb import ERRORS_ONLY

    class Stub:
        metadata = "not opened"

        async def InitCache(self, request):
            return None

        def Step(self, metadata=None):
            self.metadata = metadata
            return "the gRPC stream"

    async def main():
        group = WorkerGroup([f"unix://{tmp_path}/rank0.sock", f"unix://{tmp_path}/rank1.sock"], 60.0)
        group._stubs = [Stub(), Stub()]
        attached = []
        group._attach = attached.extend
        try:
            await group.start(8)
        finally:
            await asyncio.gather(*(channel.close() for channel in group._channels))
        return attached, [stub.metadata for stub in group._stubs]

    attached, metadata = asyncio.run(main())
    assert attached == ["the gRPC stream"] * 2
    assert metadata == [None, (ERRORS_ONLY,)]
