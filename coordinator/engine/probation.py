"""Finding the request that breaks the worker group, so that it fails alone.

A step fails when a rank raises or dies, and a request can be the cause: an input that
reaches a kernel's bug, a prompt whose prefill runs a GPU out of memory. The group is
restarted and every request resumes by recompute (launch/recovery.py), so such a request
would break the new group too. Failing every request then (as vLLM's and SGLang's engines
do when their core dies) makes one client's request everyone's outage.

Instead the sequences of the failed step become *suspects*. After the restart each one
runs alone, oldest first, while the others wait: its recompute (a prefill of its prompt
and the tokens it had) and then one decode step, the two paths its failed step may have
taken, before the next suspect's turn. A suspect that completes them is cleared; a step
that fails holding one suspect alone fails that request with INTERNAL and restarts the
group again for the rest. Only then, with every suspect cleared or failed, do the
others run, batched as before.

A group that fails whatever it runs (a broken checkpoint, a bad device) is not a poisoned
request: :data:`MAX_FAILURES_WITHOUT_A_STEP` failed steps with no step succeeding between
them fail every request and stop the server, as before (at most one innocent suspect
failed on the way). Each isolation costs a restart per poisoned request and a few solo
steps per suspect; it happens only after a failure. No torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from coordinator.engine.outputs import RequestState
from coordinator.sequence import Sequence

#: Failed steps in a row, no step succeeding between them, after which the group itself is judged broken:
#: the first failure makes suspects, the second fails one of them alone (a poisoned request), a third
#: can no longer be one request's doing.
MAX_FAILURES_WITHOUT_A_STEP = 3

#: Tokens a suspect must sample after a restart to be cleared: the first ends its recompute (a prefill),
#: the second is a decode step's, so both paths its failed step may have taken have run.
TOKENS_TO_CLEAR = 2


class Probation:
    """The suspects of failed steps, in the order they run alone (oldest sequence first).

    Sequences are named by id; a suspect that finished or was forgotten (cancelled, its
    deadline passed) meanwhile leaves probation without running.
    """

    def __init__(self) -> None:
        self._suspects: dict[int, int] = {}  # seq id -> output tokens it must reach to be cleared
        self.failures_without_a_step = 0

    def __bool__(self) -> bool:
        return bool(self._suspects)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._suspects

    def suspect(self, seqs: Iterable[Sequence]) -> None:
        """The sequences of a step that failed: each must run alone after the restart."""
        for seq in sorted(seqs, key=lambda s: s.seq_id):
            self._suspects.setdefault(seq.seq_id, seq.num_output_tokens + TOKENS_TO_CLEAR)

    def next(self, live: Mapping[int, RequestState]) -> Sequence | None:
        """The suspect to run alone now, or None: probation is over. ``live``: seq id -> the state of every
        sample in flight; suspects no longer there, or finished, or past their tokens, are cleared."""
        for seq_id, target in list(self._suspects.items()):
            state = live.get(seq_id)
            seq = None if state is None else state.seq
            if seq is None or seq.is_finished or seq.num_output_tokens >= target:
                del self._suspects[seq_id]
                continue
            return seq
        return None

    def convict(self, seq_id: int) -> None:
        """The suspect failed a step it ran alone: it leaves probation (its request fails)."""
        self._suspects.pop(seq_id, None)

    def step_failed(self) -> bool:
        """Counts a failed step; True: too many in a row, the group itself is broken."""
        self.failures_without_a_step += 1
        return self.failures_without_a_step >= MAX_FAILURES_WITHOUT_A_STEP

    def step_succeeded(self) -> None:
        self.failures_without_a_step = 0
