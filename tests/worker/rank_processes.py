"""Start the rank processes of multi-process tests from one fork server that has imported torch.

``torch.multiprocessing.spawn`` starts every rank as a fresh interpreter that imports
torch and the worker again: about 3 CPU-seconds per rank, which made process start-up,
not the checks, most of the multi-process tests' time. Here the ranks are forked from a
server process (``multiprocessing``'s "forkserver" start method) that imported those
modules once per test session; a 2-rank group then starts in well under a second. Each
group is still new processes joined in a new process group, so no state passes between
tests (a test that kills a rank loses nothing but its own group).

A forked rank inherits the fork server's environment, not the test's, so
:func:`spawn_ranks` sends the test's ``os.environ`` along and each rank installs it
before running: ``monkeypatch.setenv`` reaches the ranks as it did with spawn.

``TPSERVE_TEST_START_METHOD=spawn`` starts the ranks the old way (to compare, or if a
platform's fork server misbehaves; nothing the fork server imports initialises CUDA, so
NCCL ranks fork from it as well).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

#: Imported once, in the fork server, before any rank is forked: what every rank would import anyway.
PRELOAD = ["torch", "torch.distributed", "worker.parallel_state", "worker.model_runner", "tests.worker.tp_harness"]


def _run_with_environment(rank: int, environment: dict[str, str], fn: Callable[..., None],
                          args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, *args)


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and wait for all of them, as ``mp.spawn`` does.

    ``fn`` must be a module-level function (it is pickled by reference). Raises
    ``torch.multiprocessing.ProcessRaisedException`` / ``ProcessExitedException`` when a rank
    raises or exits with a non-zero code, as ``mp.spawn`` does.
    """
    # Takes effect when the fork server starts (the first call); later calls change nothing.
    multiprocessing.set_forkserver_preload(PRELOAD)
    start_method = os.environ.get("TPSERVE_TEST_START_METHOD", "forkserver")
    mp.start_processes(_run_with_environment, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True,
                       start_method=start_method)
