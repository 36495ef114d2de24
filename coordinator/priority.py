"""Who goes first and who is preempted: request priority with aging, and preemption only after progress.

The ordering rule (docs/design/scheduling.md, "Priority ages"). A request's *effective* priority is

    effective = priority - waited_s / priority_aging_s

lower first, as vLLM's ``priority`` (lower values are more urgent). Every request ages at
the same rate from the moment it reaches the scheduler, so comparing two effective
priorities never depends on *when* they are compared: ``a`` goes before ``b`` exactly
when ``arrival_a + priority_a * aging_s < arrival_b + priority_b * aging_s``. So a
request is ranked once, at arrival, by that *virtual arrival time* (an earliest-deadline
order, as EEVDF's virtual deadlines), and the waiting queue stays a sorted list with no
re-sorting as time passes. In words: one priority level is worth ``aging_s`` seconds of
waiting; a request of priority ``p`` is ordered as if it had arrived ``p * aging_s``
seconds later. Equal ranks keep arrival order (sequence ids). The same rank picks the
preemption victim (the largest rank: least urgent, then newest) and decides whether a
waiting request may preempt a running one (a strictly smaller rank), so a request that
has aged past later urgent arrivals is neither overtaken nor preempted by them: a
request of priority ``p`` waits at most about ``(p - p_min) * aging_s`` seconds plus the
service time of what ranked before it, where ``p_min`` is the most urgent priority
callers may use (bounding that is the API keys' business, not the scheduler's).
vLLM orders by ``(priority, arrival)`` with no aging (``aging_s = 0`` here: strict
priority, which can starve); OS schedulers age waiting work the same way.

The progress rule: an admitted sequence (new, or resumed after a preemption and
recomputed from its tokens) is not preempted until it has produced a token since, so a
low-priority stream under KV pressure loses its KV at most once per token it produces
instead of being preempted again and again in the middle of its (re)computation, each
time throwing that work away. It never deadlocks: a protected sequence is passed over
for another victim; when every candidate is protected, the sequence that needs blocks
waits a step if some other sequence runs in this step (which frees or takes blocks
towards an end), and only when nothing else would run is a protected sequence preempted
(the least urgent, newest one), so every step makes progress. No torch.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from coordinator.sequence import Sequence

#: Seconds of waiting that equal one priority level (``--priority-aging-seconds``).
DEFAULT_PRIORITY_AGING_S = 10.0


class PriorityPolicy:
    """The ordering and preemption rules of the module docstring.

    Args:
        aging_s: seconds of waiting worth one priority level (>= 0); 0: strict priority,
            no aging (vLLM's order).
        clock: seconds, monotonic (tests inject a simulated one).

    Raises:
        ValueError: a negative or non-finite ``aging_s``.
    """

    def __init__(self, aging_s: float = DEFAULT_PRIORITY_AGING_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= aging_s < float("inf"):
            raise ValueError(f"priority_aging_seconds must be finite and >= 0, got {aging_s}")
        self.aging_s = aging_s
        self.clock = clock

    def stamp(self, seq: Sequence) -> None:
        """Records when ``seq`` reached the scheduler (once: a preempted sequence keeps its age)."""
        if seq.arrival_s is None:
            seq.arrival_s = self.clock()

    def rank(self, seq: Sequence) -> float:
        """The sequence's place in the order, lower first (its virtual arrival time, in seconds;
        its priority when aging is off)."""
        if not self.aging_s:
            return seq.priority
        return (seq.arrival_s or 0.0) + seq.priority * self.aging_s

    def effective_priority(self, seq: Sequence, now: float | None = None) -> float:
        """``priority - waited_s / aging_s`` at ``now`` (default: the clock); ordering by it equals ordering by :meth:`rank`."""
        if not self.aging_s:
            return seq.priority
        waited = (self.clock() if now is None else now) - (seq.arrival_s or 0.0)
        return seq.priority - waited / self.aging_s

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """Puts ``seq`` in the sorted ``waiting`` queue after every sequence of a rank not above its own
        (by arrival: a preempted sequence goes before the later arrivals of its rank)."""
        key = (self.rank(seq), seq.seq_id)
        waiting.insert(bisect.bisect_right(waiting, key, key=lambda s: (self.rank(s), s.seq_id)), seq)

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether ``waiting`` may preempt ``running`` to take its place (strictly more urgent now)."""
        return self.rank(waiting) < self.rank(running)

    @staticmethod
    def on_admitted(seq: Sequence) -> None:
        """Starts an admitted sequence's protection: it is not preempted before its next token."""
        seq.admitted_at_output = seq.num_output_tokens

    @staticmethod
    def is_protected(seq: Sequence) -> bool:
        """Whether ``seq`` has produced no token since it was last admitted."""
        return seq.admitted_at_output is not None and seq.num_output_tokens <= seq.admitted_at_output

    def pick_victim(self, candidates: list[Sequence], allow_protected: bool) -> Sequence | None:
        """The sequence to preempt for want of KV blocks: the least urgent, then newest (the last
        in ``candidates``, which are in running order) of those not protected.

        Args:
            candidates: the running sequences that may be preempted, in running order.
            allow_protected: when every candidate is protected, preempt one anyway (True: the
                caller would otherwise schedule nothing in this step) or pick none (False).

        Returns:
            The victim, or None (no candidate, or every one protected and not ``allow_protected``).
        """
        eligible = [i for i, seq in enumerate(candidates) if not self.is_protected(seq)]
        if not eligible and allow_protected:
            eligible = list(range(len(candidates)))
        if not eligible:
            return None
        return candidates[max(eligible, key=lambda i: (self.rank(candidates[i]), i))]
