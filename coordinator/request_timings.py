"""One request's time on the server as data: :class:`RequestTimings` and :func:`timings_of`, which
computes them from the instants the engine noted (coordinator/request_timeline.py stamps them on
a request's last output; coordinator/tracing.py writes its spans from them). No torch; imports
nothing of the request path, so that both can.

All times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.sequence import Sequence


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
