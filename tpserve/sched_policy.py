"""Linux scheduling policies: the coordinator runs under ``SCHED_BATCH``, the ranks under ``SCHED_OTHER``.

Per streamed token, grpc.aio's completion-queue thread wakes once to hand the finished write
to the event loop. Under the default policy each of those wakeups preempts whatever runs on
the core (often the event loop itself, which is still writing the step's other streams): on
the 2-core test host the coordinator's main thread was switched out about once per token
(1.08 involuntary context switches per token at 64 streams, /proc/<pid>/task/*/status), and
the kernel's switching was a quarter of the coordinator's CPU. ``SCHED_BATCH`` (sched(7):
the thread is taken to be CPU-bound, and its wakeups do not preempt a running thread) lets
the event loop run on while completions queue up, which the completion-queue thread then
hands over several at a time. Measured (benchmarks/README.md, "uvloop and SCHED_BATCH"):
CPU per token 0.67x at 64 streams and 0.80x at 256, 37 % and 15 % more tokens per second.

Where cores are free, as on a GPU server, a batch thread is placed on an idle core at once,
so nothing waits. The ranks compute the step, and their OpenMP threads must not wait behind
anyone's time slice: a rank resets itself to ``SCHED_OTHER`` at start-up (it would otherwise
inherit the coordinator's policy, as every child process does).

Best effort: where the policy cannot be set (not Linux, or refused), nothing changes.
"""

from __future__ import annotations

import os

#: Policy name -> ``os.SCHED_*`` value where this platform has it.
POLICIES = {name: getattr(os, f"SCHED_{name.upper()}") for name in ("batch", "other")
            if hasattr(os, f"SCHED_{name.upper()}")}


def set_policy(name: str) -> bool:
    """Puts every thread of this process under policy ``name`` (``"batch"`` or ``"other"``), nice value kept.

    Threads started later inherit their creator's policy, and so do child processes. Returns
    whether every thread now has it: False where the platform lacks the policy or the kernel
    refused it (each thread is tried; one that exits meanwhile is skipped).

    Raises:
        ValueError: ``name`` is neither ``"batch"`` nor ``"other"``.
    """
    if name not in ("batch", "other"):
        raise ValueError(f"unknown scheduling policy {name!r}: 'batch' or 'other'")
    if name not in POLICIES or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # the calling thread only
    ok = True
    for tid in threads:
        try:
            os.sched_setscheduler(tid, POLICIES[name], os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError:
            ok = False
    return ok


def policy_name() -> str:
    """This thread's policy: ``"batch"``, ``"other"``, another ``SCHED_*`` name in lower case, or ``"unknown"``."""
    if not hasattr(os, "sched_getscheduler"):
        return "unknown"
    value = os.sched_getscheduler(0)
    for attr in dir(os):
        if attr.startswith("SCHED_") and attr != "SCHED_RESET_ON_FORK" and getattr(os, attr) == value:
            return attr[len("SCHED_"):].lower()
    return "unknown"
