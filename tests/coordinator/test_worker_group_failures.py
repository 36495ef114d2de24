"""WorkerGroup acts on the first rank that fails a step, not after every rank answers (docs/design/faults.md, "The
first rank error fails the step").

The ranks' Step streams are replaced by in-process fakes: rank 1 answers with an
error at once while rank 0 never answers (as a rank blocked in a collective waits
for its failed peer until the collective timeout). Rank 1's stream answers only
failures (tpserve/step_pb.py, ``ERRORS_ONLY``): the group watches it with a read of its own.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from coordinator.worker_client import WorkerGroup, WorkerGroupError
from tpserve.step import StepPlan
from tpserve.step_pb import STEP_PROTOCOL
from tpserve.v1 import worker_pb2 as pb
from tpserve.v1 import worker_pb2_grpc


class _FakeStream:
    """A Step stream whose every read answers ``answer`` after ``delay_s`` (None: never).

    ``cancel()`` makes a pending ``read`` raise CancelledError in its reader, as a grpc.aio call
    does, without the reader's task being cancelled.
    """

    def __init__(self, answer, delay_s: float | None) -> None:
        self.answer, self.delay_s = answer, delay_s
        self.cancelled = False
        self.reads = 0
        self._reading: asyncio.Future | None = None

    async def write(self, msg: pb.StepPlan) -> None:
        pass

    async def read(self):
        if self.cancelled:
            raise asyncio.CancelledError
        self.reads += 1
        self._reading = reading = asyncio.get_running_loop().create_future()
        if self.delay_s is not None:
            asyncio.get_running_loop().call_later(self.delay_s, lambda: reading.done() or reading.set_result(self.answer))
        return await reading

    def cancel(self) -> None:
        self.cancelled = True
        if self._reading is not None and not self._reading.done():
            self._reading.cancel()


def _run(streams: list[_FakeStream], step_timeout_s: float = 60.0, num_steps: int = 1):
    async def main():
        group = WorkerGroup([f"unix:///nonexistent/rank{r}.sock" for r in range(len(streams))], step_timeout_s)
        group._attach(streams)
        start = time.monotonic()
        try:
            return await group.execute(StepPlan(step_id=7, num_steps=num_steps)), time.monotonic() - start
        except WorkerGroupError as exc:
            return exc, time.monotonic() - start
        finally:
            await group.close()

    return asyncio.run(main())


def test_the_first_rank_error_fails_the_step_at_once() -> None:
    error = pb.StepResult(step_id=7, error="rank 1: step 7 failed: OutOfMemoryError: CUDA out of memory")
    outcome, elapsed = _run([_FakeStream(None, None), _FakeStream(error, 0.01)])
    assert isinstance(outcome, WorkerGroupError)
    assert "OutOfMemoryError" in str(outcome)
    assert elapsed < 1.0


def test_a_rank_closing_its_stream_fails_the_step_at_once() -> None:
    outcome, elapsed = _run([_FakeStream(None, None), _FakeStream(grpc.aio.EOF, 0.01)])
    assert isinstance(outcome, WorkerGroupError) and "closed its stream" in str(outcome)
    assert elapsed < 1.0


def test_every_rank_answering_returns_rank_0s_tokens() -> None:
    outcome, _ = _run([_FakeStream(pb.StepResult(step_id=7, sampled_token_ids=[4, 5]), 0.05),
                       _FakeStream(pb.StepResult(step_id=7), 0.01)])
    assert outcome.sampled_token_ids == (4, 5)


def test_a_watched_rank_whose_stream_breaks_fails_the_step_at_once() -> None:
    class Broken(_FakeStream):
        async def read(self):
            await asyncio.sleep(0.01)
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Socket closed")

    outcome, elapsed = _run([_FakeStream(None, None), Broken(None, None)])
    assert isinstance(outcome, WorkerGroupError)
    assert "step 7 failed: rank 1's step stream broke (UNAVAILABLE: Socket closed)" in str(outcome)
    assert elapsed < 1.0


def test_a_plan_being_written_when_a_watched_rank_fails_names_that_failure() -> None:
    """The watcher cancels the sampling rank's call under a write in progress; grpc.aio then raises
    InvalidStateError ("RPC already finished") from the write: the step names rank 1's error."""
    class WriteUntilCancelled(_FakeStream):
        async def write(self, msg: pb.StepPlan) -> None:
            self._reading = asyncio.get_running_loop().create_future()
            try:
                await self._reading
            except asyncio.CancelledError:
                raise asyncio.InvalidStateError("RPC already finished.") from None

    error = pb.StepResult(step_id=7, error="rank 1: step 7 failed: RuntimeError: boom")
    outcome, elapsed = _run([WriteUntilCancelled(None, None), _FakeStream(error, 0.01)])
    assert isinstance(outcome, WorkerGroupError) and elapsed < 1.0
    assert str(outcome) == "step 7 failed: rank 1: step 7 failed: RuntimeError: boom"


def test_a_rank_that_answers_only_failures_costs_one_read_in_all_and_fails_the_next_step() -> None:
    """Steps wait for the sampling rank alone; the other rank's stream has one read open throughout.
    A failure it reports between steps fails the next submit with its reason."""
    async def main():
        group = WorkerGroup(["unix:///nonexistent/rank0.sock", "unix:///nonexistent/rank1.sock"], 60.0)
        rank0, rank1 = _FakeStream(pb.StepResult(step_id=1, sampled_token_ids=[4]), 0.001), _CancellableStream()
        group._attach([rank0, rank1])
        try:
            tokens = [(await group.execute(StepPlan(step_id=i))).sampled_token_ids for i in range(5)]
            assert tokens == [(4,)] * 5 and (rank0.reads, rank1.reads) == (5, 1)
            rank1._reading.set_result(pb.StepResult(step_id=5, error="rank 1: step 5 failed: RuntimeError: boom"))
            await asyncio.sleep(0.01)
            assert rank0.cancelled  # its reads would have waited on a peer that is gone
            with pytest.raises(WorkerGroupError, match="rank 1: step 5 failed: RuntimeError: boom"):
                await group.execute(StepPlan(step_id=6))
        finally:
            await group.close()

    asyncio.run(main())


@pytest.mark.parametrize("num_ranks", [1, 2])  # one rank is read directly, several through tasks
@pytest.mark.parametrize("step_timeout_s", [0.2])
def test_a_silent_group_still_times_out(step_timeout_s: float, num_ranks: int) -> None:
    outcome, elapsed = _run([_FakeStream(None, None) for _ in range(num_ranks)], step_timeout_s)
    assert isinstance(outcome, WorkerGroupError) and "timed out after" in str(outcome)
    assert step_timeout_s <= elapsed < step_timeout_s + 1.0


def test_a_multi_step_plan_has_the_step_timeout_once_per_step() -> None:
    """A plan of 4 steps (--num-scheduler-steps) answered after 0.5 s is no timeout at 0.2 s a step; a silent one
    times out after 0.8 s, and the error says so."""
    answer = pb.StepResult(step_id=7, sampled_token_ids=[5, 6, 7, 8])
    outcome, elapsed = _run([_FakeStream(answer, 0.5)], 0.2, num_steps=4)
    assert not isinstance(outcome, WorkerGroupError), outcome
    outcome, elapsed = _run([_FakeStream(None, None)], 0.2, num_steps=4)
    assert isinstance(outcome, WorkerGroupError) and str(outcome) == "step 7 timed out after 0.8 s"
    assert 0.8 <= elapsed < 1.8


def test_a_single_rank_answers_and_its_broken_stream_is_named() -> None:
    outcome, _ = _run([_FakeStream(pb.StepResult(step_id=7, sampled_token_ids=[9]), 0.01)])
    assert outcome.sampled_token_ids == (9,)

    class Broken(_FakeStream):
        async def read(self):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Socket closed")

    outcome, elapsed = _run([Broken(None, 0.0)])
    assert isinstance(outcome, WorkerGroupError) and "rank 0's step stream broke (UNAVAILABLE: Socket closed)" \
        in str(outcome) and elapsed < 1.0


class _CancellableStream(_FakeStream):
    """Never answers (until ``cancel()``)."""

    def __init__(self) -> None:
        super().__init__(None, None)


def test_a_step_interrupted_by_close_fails_instead_of_cancelling_the_caller() -> None:
    # The group is declared lost (a node's registry link dropped) while a step waits in a collective:
    # the restart closes the group, and the engine loop must see a failed step, not die (docs/design/faults.md,
    # "Recovery").
    async def main():
        group = WorkerGroup(["unix:///nonexistent/rank0.sock", "unix:///nonexistent/rank1.sock"], 60.0)
        group._attach([_CancellableStream(), _CancellableStream()])
        step = asyncio.create_task(group.execute(StepPlan(step_id=7)))
        await asyncio.sleep(0.05)
        await group.close()
        try:
            return await step
        except WorkerGroupError as exc:
            return exc

    outcome = asyncio.run(main())
    assert isinstance(outcome, WorkerGroupError) and "step streams were closed" in str(outcome)


def test_cancelling_the_caller_of_a_step_still_cancels_it() -> None:
    async def main():
        group = WorkerGroup(["unix:///nonexistent/rank0.sock"], 60.0)
        group._attach([_CancellableStream()])
        step = asyncio.create_task(group.execute(StepPlan(step_id=7)))
        await asyncio.sleep(0.05)
        step.cancel()
        try:
            await step
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            await group.close()

    assert asyncio.run(main()) == "cancelled"


class _EndsAtOnce(worker_pb2_grpc.WorkerServiceServicer):
    """A real WorkerService whose Step call ends as soon as it opens (a rank killed under an open stream)."""

    async def Step(self, requests, context):  # noqa: N802 - the gRPC method's name
        return
        yield  # an async generator: a streaming response with no message


def test_a_plan_written_to_a_stream_that_already_ended_fails_the_group_not_the_loop() -> None:
    """grpc.aio raises asyncio.InvalidStateError ("RPC already finished") for a write on a call that ended:
    a rank died between two steps. The engine's overlap writes the next plan before reading the last
    answers, so this reached the loop as a bug (tests/e2e/test_recovery.py failed on it once)."""
    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(_EndsAtOnce(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        group = WorkerGroup([f"127.0.0.1:{port}"], 10.0)
        try:
            group._attach([stub.Step() for stub in group._stubs])
            await group._streams[0].code()  # the call has ended
            with pytest.raises(WorkerGroupError, match="step 7 failed: a step stream broke"):
                await group.submit(StepPlan(step_id=7))
            assert group.failed
        finally:
            await group.close()
            await server.stop(None)

    asyncio.run(main())


class _BlockedWriteStream(_CancellableStream):
    """Its ``write`` waits until the call is cancelled (a rank that stopped reading: flow control)."""

    async def write(self, msg: pb.StepPlan) -> None:
        self._reading = asyncio.get_running_loop().create_future()
        await self._reading


@pytest.mark.parametrize("where", ["writing the plan", "waiting for the answer"])
def test_a_cancelled_caller_is_cancelled_even_when_the_group_closes_under_it(where: str) -> None:
    """Shutdown cancels the engine loop and then closes the group: the loop must end cancelled, not
    see a failed group (which made a clean shutdown exit 1)."""
    async def main():
        group = WorkerGroup(["unix:///nonexistent/rank0.sock", "unix:///nonexistent/rank1.sock"], 60.0)
        stream = _BlockedWriteStream if where == "writing the plan" else _CancellableStream
        group._attach([stream(), stream()])
        step = asyncio.create_task(group.execute(StepPlan(step_id=7)))
        await asyncio.sleep(0.05)
        step.cancel()  # as Shutdown.drain: the engine loop first, then launcher.shut_down closes the group
        await group.close()
        try:
            await step
        except asyncio.CancelledError:
            return "cancelled"
        except WorkerGroupError as exc:
            return exc

    assert asyncio.run(main()) == "cancelled"


def test_a_cancellation_that_asyncio_wait_for_swallows_still_cancels_the_step(monkeypatch) -> None:
    """Python 3.11's wait_for returns the inner result when it ends just as the caller is cancelled,
    losing the cancellation (gh-86296): at shutdown the engine loop then waited on one more step, and
    the group's close() under it read as a group failure (tests/e2e/test_shutdown_signals.py, exit 1)."""
    if not hasattr(asyncio.Task, "cancelling"):
        pytest.skip("Task.cancelling() is Python 3.11+; 3.10's wait_for has no such count to lose")

    async def swallowing_wait_for(awaitable, timeout):
        result = await awaitable
        asyncio.current_task().cancel()  # the cancellation arrives as the writes end...
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # ...and is swallowed: cancelling() stays 1, nothing is raised
        return result

    monkeypatch.setattr("coordinator.worker_client.asyncio.wait_for", swallowing_wait_for)

    async def main():
        group = WorkerGroup(["unix:///nonexistent/rank0.sock"], 60.0)
        group._attach([_FakeStream(pb.StepResult(step_id=7, sampled_token_ids=[4]), 0.01)])
        try:
            await group.execute(StepPlan(step_id=7))
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            await group.close()
        return "ran on"

    assert asyncio.run(main()) == "cancelled"


class _SilentRank(worker_pb2_grpc.WorkerServiceServicer):
    """A rank that is alive but stuck: it accepts the liveness check and never answers."""

    async def GetStatus(self, request, context):
        await asyncio.Event().wait()


@pytest.mark.parametrize(("ranks", "stuck", "says"), [
    (["silent"], True, "rank 0 did not answer a liveness check within 0.3 s"),
    (["gone"], False, "rank 0 failed: its liveness check ended with UNAVAILABLE"),
    (["silent", "gone"], False, "rank 1 failed"),  # one rank gone: a worker failure, whatever the others do
])
def test_the_liveness_watch_tells_a_stuck_rank_from_a_gone_one(ranks: list[str], stuck: bool, says: str) -> None:
    """Stuck (no answer in time): the group is down, UNAVAILABLE. Gone (its connection refused): a worker
    failure, INTERNAL, the code a step reports when it finds the loss first (launch/recovery.py)."""
    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(_SilentRank(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        addresses = [f"127.0.0.1:{port}" if kind == "silent" else "unix:///nonexistent/rank.sock" for kind in ranks]
        group = WorkerGroup(addresses, step_timeout_s=60.0)
        try:
            return await asyncio.wait_for(group.watch_liveness(interval_s=0.05, timeout_s=0.3), 10)
        finally:
            await group.close()
            await server.stop(None)

    loss = asyncio.run(main())
    assert loss.stuck is stuck
    assert says in loss.reason, loss.reason


class _LoadedRank(worker_pb2_grpc.WorkerServiceServicer):
    """A rank that has loaded its shard and reads step protocol ``step_protocol``."""

    def __init__(self, step_protocol: int) -> None:
        self.step_protocol = step_protocol

    async def GetStatus(self, request, context):
        return pb.WorkerStatus(rank=0, world_size=1, ready=True, num_kv_blocks_available=77, dtype="float32",
                               device="cpu", num_threads=1, step_protocol=self.step_protocol)


@pytest.mark.parametrize("step_protocol", [STEP_PROTOCOL, 0, STEP_PROTOCOL + 1])
def test_a_rank_of_another_step_protocol_is_refused_before_any_step(step_protocol: int) -> None:
    """A rank of another tpserve version would read the plans' bytes as another batch (protobuf skips
    unknown fields): the group refuses it while it waits for the ranks, with both versions named."""
    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(_LoadedRank(step_protocol), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        group = WorkerGroup([f"127.0.0.1:{port}"], step_timeout_s=60.0)
        try:
            return await group.wait_ready(timeout_s=10)
        finally:
            await group.close()
            await server.stop(None)

    if step_protocol == STEP_PROTOCOL:
        assert asyncio.run(main()) == 77
        return
    with pytest.raises(WorkerGroupError, match=f"rank 0 reads step protocol {step_protocol} and this coordinator "
                                               f"writes {STEP_PROTOCOL}: the group runs two tpserve versions"):
        asyncio.run(main())
