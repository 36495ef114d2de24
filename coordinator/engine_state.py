"""The engine's life cycle as one state with explicit transitions (docs/design/scheduling.md, "The engine's states
are one enum").

::

    SERVING ──drain──▶ DRAINING
       │  ▲               │
 suspend  first step ok   suspend (the group is lost mid-drain)
       ▼  │               ▼
    RESUMED ◀──resume── RECOVERING
       │
       └──suspend──▶ RECOVERING        every state ──fail──▶ DEAD

- SERVING: steps run, new requests are admitted.
- DRAINING: steps run until the requests in flight finish; new ones are refused.
- RECOVERING: the worker group was lost and is being restarted; every sequence waits
  for recompute, new requests are refused, the loop waits for ``resume``.
- RESUMED: on the restarted group, before its first step succeeds. A step that fails here
  restarts the group again, its suspect failed alone (coordinator/engine/probation.py), or,
  the third failure without a step succeeding between them, fails every request.
- DEAD: the group failed for good; every request got its error. Final.

No torch.
"""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    RECOVERING = "recovering"
    RESUMED = "resumed"
    DEAD = "dead"

    @property
    def runs_steps(self) -> bool:
        """Whether the loop may schedule a step (the group is up)."""
        return self in (EngineState.SERVING, EngineState.DRAINING, EngineState.RESUMED)


#: state -> the states it may move to. Anything else is a bug (RuntimeError).
TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    EngineState.SERVING: frozenset({EngineState.DRAINING, EngineState.RECOVERING, EngineState.DEAD}),
    EngineState.DRAINING: frozenset({EngineState.RECOVERING, EngineState.DEAD}),
    EngineState.RECOVERING: frozenset({EngineState.RESUMED, EngineState.DEAD}),
    EngineState.RESUMED: frozenset({EngineState.SERVING, EngineState.DRAINING, EngineState.RECOVERING,
                                    EngineState.DEAD}),
    EngineState.DEAD: frozenset({EngineState.DEAD}),  # a second failure only re-reports
}


def check_transition(current: EngineState, new: EngineState) -> None:
    """Raises RuntimeError when the life cycle does not allow ``current`` -> ``new``."""
    if new not in TRANSITIONS[current]:
        raise RuntimeError(f"engine state {current.value} cannot become {new.value}")
