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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from coordinator import tracing

if TYPE_CHECKING:
    from coordinator.request_output import RequestOutput
    from coordinator.request_table import RequestEntry
    from coordinator.sequence import Sequence


class SampleState(Protocol):
    """What :func:`stamp_timings` reads of the engine's state of one sample."""

    seq: Sequence
    first_token_time: float | None


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """One sample's time on the server, in seconds; the phases add up to ``e2e_time_s``.

    Attributes:
        queue_time_s: received until first admitted (validation, tokenization, grammar, waiting).
        prefill_time_s: first admitted until the first token (0 without one).
        decode_time_s: first token until the last output was taken (0 without a first token).
        time_to_first_token_s: received until the first token (0 without one).
        num_preemptions: times its KV blocks were taken back and recomputed.
        cached_prompt_tokens: prompt tokens found in the prefix cache.
        received_s, admitted_s, first_token_s, finished_s: the instants themselves
            (``time.monotonic()``; admitted_s and first_token_s are None when it never got there).
        preempted_s, resumed_s: each preemption's instant, and each re-admission's after one.
        prefill_chunks: each prefill chunk's end and the positions ``[start, end)`` it computed
            (:attr:`Sequence.prefill_chunks_s`), recomputes after a preemption included.
    """

    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float
    time_to_first_token_s: float
    num_preemptions: int
    cached_prompt_tokens: int
    received_s: float
    admitted_s: float | None
    first_token_s: float | None
    finished_s: float
    preempted_s: tuple[float, ...] = ()
    resumed_s: tuple[float, ...] = ()
    prefill_chunks: tuple[tuple[float, int, int], ...] = ()

    @property
    def e2e_time_s(self) -> float:
        """Received until the last output was taken: queue + prefill + decode."""
        return self.finished_s - self.received_s


def timings_of(received_s: float, seq: Sequence | None, first_token_s: float | None,
               now: float) -> RequestTimings:
    """The timings of a sample that ends at ``now``; ``seq`` None: it never reached the queue.

    Instants are clamped into order (received <= admitted <= first token <= now) so that
    the phases are never negative and always add up to ``now - received_s``.
    """
    admitted = seq.admitted_s[0] if seq is not None and seq.admitted_s else None
    admitted = None if admitted is None else min(max(admitted, received_s), now)
    first = None if first_token_s is None or admitted is None else min(max(first_token_s, admitted), now)
    queue_end = now if admitted is None else admitted
    prefill_end = queue_end if admitted is None else (now if first is None else first)
    return RequestTimings(
        queue_time_s=queue_end - received_s, prefill_time_s=prefill_end - queue_end, decode_time_s=now - prefill_end,
        time_to_first_token_s=0.0 if first is None else first - received_s,
        num_preemptions=0 if seq is None else seq.num_preemptions,
        cached_prompt_tokens=0 if seq is None else seq.num_cached_prompt_tokens or 0,
        received_s=received_s, admitted_s=admitted, first_token_s=first, finished_s=now,
        preempted_s=() if seq is None else tuple(seq.preempted_s),
        resumed_s=() if seq is None else tuple(seq.admitted_s[1:]),
        prefill_chunks=() if seq is None else tuple(seq.prefill_chunks_s))


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
