"""The event loop the server and the load client run on: uvloop where it is installed, else asyncio's own.

Per streamed token the coordinator runs a few loop callbacks: the stream's handler wakes, its
``context.write`` completes through grpc.aio's completion-queue reader, the engine's step
result arrives. At 64 and 256 streams these callbacks are a measurable part of the
coordinator's CPU per token (docs/design/request-path.md), and uvloop (libuv's loop in Cython, a drop-in
``asyncio`` loop) runs them for less: ``benchmarks/coordinator_cpu.py`` measured 0.86x of
the CPU per token at 64 streams and 0.93x at 256, same run (benchmarks/README.md). vLLM's and SGLang's
API servers run on uvloop for the same reason.

uvloop is a runtime dependency on Linux and macOS; where it is not installed (Windows) the
standard loop runs and nothing else changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def running_loop_name() -> str:
    """The running loop's package: ``"uvloop"`` or ``"asyncio"`` (the ``serving`` log line's ``event_loop``).

    Raises ``RuntimeError`` outside a running loop, as :func:`asyncio.get_running_loop`.
    """
    return type(asyncio.get_running_loop()).__module__.split(".", 1)[0]


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs ``main`` to completion on a new event loop (uvloop's where installed) and closes the loop.

    As :func:`asyncio.run`: cancels what is left running at the end, shuts the default executor
    down, and raises what ``main`` raises.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
