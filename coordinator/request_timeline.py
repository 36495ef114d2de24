"""Where one request's time went: queue, prefill, decode, time to first token, preemptions.

The engine notes a handful of instants per request, never per step or per token: when
the request was received (:attr:`RequestEntry.received_s`), each time the scheduler
admitted it and each time it was preempted (:attr:`Sequence.admitted_s`,
:attr:`Sequence.preempted_s`), and its first token (the engine's ``first_token_time``).
:func:`stamp_timings` turns them into a :class:`RequestTimings` on the request's last
output, when its handler takes it, so the three phases add up to the request's time on
the server, and hands them to tracing when it is on (coordinator/tracing.py). vLLM keeps
the same instants (``RequestStateStats``) for its metrics; here the caller gets them too.

All times are ``time.monotonic()`` seconds. No torch.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Protocol

from coordinator import tracing
from coordinator.request_timings import RequestTimings, timings_of  # noqa: F401 - RequestTimings re-exported

if TYPE_CHECKING:
    from coordinator.request_output import RequestOutput
    from coordinator.request_table import RequestEntry
    from coordinator.sequence import Sequence


class SampleState(Protocol):
    """What :func:`stamp_timings` reads of the engine's state of one sample."""

    seq: Sequence
    first_token_time: float | None


def stamp_timings(output: RequestOutput, entry: RequestEntry, state: SampleState | None) -> RequestOutput:
    """Sets ``output.timings`` on a sample's last output (as its handler takes it) and, with
    tracing on, records the sample's spans. Returns ``output``.

    Args:
        output: the sample's last output (finish_reason set).
        entry: its request, as registered on receipt.
        state: the engine's state of the sample; None when it ended before it was queued.
    """
    output.timings = timings = timings_of(entry.received_s, None if state is None else state.seq,
                                          None if state is None else state.first_token_time, time.monotonic())
    if entry.trace_context is not None:
        tracing.record_request(entry, output, timings, state)
    return output


def trace_unfinished(entry: RequestEntry) -> None:
    """With tracing on, records the samples of ``entry`` that ended without a last output (a
    deadline, a lost worker group, a cancel) as failed spans. Called as the request is closed."""
    now = time.monotonic()
    for state in entry.samples:
        if id(state) not in (entry.traced_samples or ()):
            seq = state.seq
            tracing.record_failed(entry, timings_of(entry.received_s, seq, state.first_token_time, now), state,
                                  seq.num_usage_prompt_tokens, seq.num_usage_completion_tokens)


def replica_name(served_model_name: str) -> str:
    """The id a replica puts in its responses: ``<served model name>@<pod name>``; the pod name
    is ``POD_NAME`` (the Kubernetes downward API), else ``HOSTNAME``, else the host's name."""
    host = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{served_model_name}@{host}"
