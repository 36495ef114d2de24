"""Which threads validate a request: a request that may take seconds never holds up one that takes microseconds.

Validation runs off the event loop, on a thread: it tokenizes the prompt (a 1 MiB text takes about a second,
several on a busy host) and may compile a grammar (up to its time limit, in a child process, the thread
waiting: coordinator/grammar_compiler.py). On one shared pool (``asyncio.to_thread``'s, ``min(32, cpus + 4)``
threads) a caller's long prompts or slow schemas fill every thread and an unrelated one-line request queues
behind them: measured on a 2-core host, twelve 1 MiB prompts that could never fit the context held another
tenant's 1-token request 10.9 s at tensor-parallel degree 1 and 28 s at 2, past a 3 s deadline.

So each request takes one of three lanes (:func:`lane`), each its own pool:

- ``long_prompt``: a request of more than :data:`LONG_PROMPT_BYTES` on the wire (a long text or chat):
  ``max(1, cpus // 4)`` threads, so long tokenizations also leave the engine loop its cores;
- ``grammar``: a ``response_format`` (a compile, or a cache hit): :data:`GRAMMAR_THREADS` threads, mostly
  waiting on the compiler's children, whose own queue bound refuses a flood with RESOURCE_EXHAUSTED;
- ``default``: everything else.

A request waits only behind its own kind. ``tokenizers`` and ``llguidance`` release the GIL while they work,
so a short request's tokenization runs beside a long one's (measured: 1.7 ms at most while two 1 MiB prompts
tokenized). No torch.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeVar

from tpserve.v1 import generate_pb2 as pb

Lane = Literal["default", "long_prompt", "grammar"]
T = TypeVar("T")

#: A request larger than this on the wire (bytes; about 16K tokens of English) takes the ``long_prompt`` lane.
LONG_PROMPT_BYTES = 64 * 1024
#: Threads of the ``grammar`` lane: they wait on the compiler's children, which bound the work themselves.
GRAMMAR_THREADS = 32

_executors: dict[Lane, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def lane(request: pb.GenerateRequest) -> Lane:
    """The lane of a tpserve.v1 ``request`` (module docstring): by its size on the wire, then its
    ``response_format``."""
    if request.ByteSize() > LONG_PROMPT_BYTES:
        return "long_prompt"
    if request.sampling_params.HasField("response_format"):
        return "grammar"
    return "default"


def _executor(name: Lane) -> ThreadPoolExecutor:
    with _lock:
        if name not in _executors:
            workers = max(1, (os.cpu_count() or 1) // 4) if name == "long_prompt" else \
                GRAMMAR_THREADS if name == "grammar" else min(32, (os.cpu_count() or 1) + 4)
            _executors[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"tpserve-validate-{name}")
        return _executors[name]


async def run_in_lane(request: pb.GenerateRequest, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a thread of ``request``'s lane, with the caller's context variables (as
    ``asyncio.to_thread``).

    Raises:
        Whatever ``fn`` raises.
    """
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_executor(lane(request)), call)
