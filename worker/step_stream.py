"""A rank's ``Step`` stream: plans run on a thread of their own, so a step never waits for a send.

gRPC's synchronous server takes a streamed response from the handler's generator, and asks
for the next one only once the send has completed. With the steps run inside that generator,
each step therefore waited for the previous result's send to complete before reading its plan.
On the 2-core test host (the 95M benchmark model, one request, timestamps on both sides of the
stream) that completion came 1.8 ms after the step ended (median), although the coordinator had
the result 0.7 ms after the step ended and the next plan was written 1.2 ms after it: about
half a millisecond of every step went to waiting for gRPC's bookkeeping. Here a thread of the
rank's own (its compute thread, worker/server.py) reads the plans and executes them; gRPC's
thread only sends what is done, and the next plan starts as soon as it arrives.

The steps still run one at a time and in order, on one thread (bound to the rank's device, for
CUDA's per-thread current device), and the results go out in the same order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

Plan = TypeVar("Plan")
Result = TypeVar("Result")

_END = object()


def serve_steps(plans: Iterator[Plan], execute: Callable[[Plan], tuple[Result, bool]],
                on_start: Callable[[], None] = lambda: None,
                spawn: Callable[[Callable[[], None]], object] | None = None) -> Iterator[Result]:
    """Yields ``execute(plan)``'s result for each plan of ``plans``, in order, executed on another thread.

    ``spawn(fn)`` runs ``fn`` (reading and executing every plan) on that thread: the rank's
    compute thread (``ThreadPoolExecutor.submit``, worker/server.py); by default a new thread.
    ``execute`` returns ``(result, last)``; with ``last`` True (a failed step) no further plan is
    read. ``on_start`` runs first on that thread (binding the rank's device to it). The stream
    ends when ``plans`` ends or raises (the coordinator closed or cancelled its side: gRPC's
    request iterator raises then), or after a last result. What ``execute`` raises is not
    caught: it ends the stream, and the exception is re-raised here to gRPC's thread.
    """
    results: queue.SimpleQueue = queue.SimpleQueue()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            on_start()
            for plan in plans:
                result, last = execute(plan)
                results.put(result)
                if last:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the stream's thread below
            failure.append(exc)
        finally:
            results.put(_END)

    if spawn is None:
        threading.Thread(target=run, name="step", daemon=True).start()
    else:
        spawn(run)
    while (result := results.get()) is not _END:
        yield result
    if failure and not _is_stream_end(failure[0]):
        raise failure[0]


def _is_stream_end(exc: BaseException) -> bool:
    """gRPC's request iterator raises an ``RpcError`` when the client cancels or the call ends: not a failure."""
    import grpc

    return isinstance(exc, grpc.RpcError)
