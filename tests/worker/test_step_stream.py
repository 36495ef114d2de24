"""worker/step_stream.py: a rank's steps run on a thread of their own, in order, never waiting for a send."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from worker.step_stream import serve_steps


def _plans(n: int):
    yield from range(n)


def test_results_come_in_plan_order_from_the_thread_spawn_gives_where_on_start_ran():
    threads, started_on = [], []

    def execute(plan: int) -> tuple[int, bool]:
        threads.append(threading.current_thread().name)
        return plan * 10, False

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-rank0") as compute:
        out = list(serve_steps(_plans(5), execute, on_start=lambda: started_on.append(threading.current_thread().name),
                               spawn=compute.submit))
    assert out == [0, 10, 20, 30, 40]
    assert set(threads) == {"compute-rank0_0"} and started_on == ["compute-rank0_0"]


def test_the_next_step_runs_while_the_previous_result_is_still_being_sent():
    """The consumer (gRPC's thread, blocked in a send) takes 0.2 s per result; step 1 must not wait for it."""
    executed = []

    def execute(plan: int) -> tuple[int, bool]:
        executed.append((plan, time.perf_counter()))
        return plan, False

    stream = serve_steps(_plans(2), execute)
    first = next(stream)
    taken = time.perf_counter()
    time.sleep(0.2)  # the send of result 0
    assert first == 0 and next(stream) == 1
    assert executed[1][1] < taken + 0.1  # step 1 ran during the send, not after it


def test_a_last_result_stops_reading_plans():
    read = []

    def plans():
        for plan in range(5):
            read.append(plan)
            yield plan

    out = list(serve_steps(plans(), lambda plan: (f"error at {plan}" if plan == 1 else plan, plan == 1)))
    assert out == [0, "error at 1"] and read == [0, 1]


def test_what_execute_raises_reaches_the_streams_thread():
    def execute(plan: int) -> tuple[int, bool]:
        if plan == 2:
            raise RuntimeError("bug in step 2")
        return plan, False

    stream = serve_steps(_plans(4), execute)
    assert [next(stream), next(stream)] == [0, 1]
    with pytest.raises(RuntimeError, match="bug in step 2"):
        next(stream)


class _Cancelled(grpc.RpcError):
    pass


def test_a_cancelled_call_ends_the_stream_without_an_error():
    def plans():
        yield 0
        raise _Cancelled()  # gRPC's request iterator, when the coordinator cancels the call

    assert list(serve_steps(plans(), lambda plan: (plan, False))) == [0]
