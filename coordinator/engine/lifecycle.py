"""The engine's life cycle: the one writer of its state (coordinator/engine_state.py).

Every change of state goes through :meth:`Lifecycle.enter`, which checks it against the
allowed transitions and wakes the step loop (a loop waiting for work or for a restart
must see a new state at once). No torch.
"""

from __future__ import annotations

import asyncio

import structlog

from coordinator.engine_state import EngineState, check_transition

log = structlog.get_logger(__name__)


class Lifecycle:
    """The engine's state and why it is in it.

    Attributes:
        state: the current state (read it; change it only with :meth:`enter`).
        reason: why the engine is RECOVERING or DEAD; None otherwise.
        changed: set on every transition (the loop waits on it while RECOVERING).
        wakeup: set on every transition and by every new request (the loop waits on it while idle).
    """

    __slots__ = ("state", "reason", "changed", "wakeup")

    def __init__(self) -> None:
        self.state = EngineState.SERVING
        self.reason: str | None = None
        self.changed = asyncio.Event()
        self.wakeup = asyncio.Event()

    def enter(self, state: EngineState, reason: str | None = None) -> None:
        """Moves to ``state``.

        Raises:
            RuntimeError: the life cycle does not allow the transition (a bug).
        """
        check_transition(self.state, state)
        log.debug("engine state", old=self.state.value, new=state.value)
        self.state, self.reason = state, reason
        self.changed.set()
        self.wakeup.set()

    @property
    def dead(self) -> str | None:
        """Why the worker group failed for good; None while it is not DEAD."""
        return self.reason if self.state is EngineState.DEAD else None

    @property
    def recovering(self) -> str | None:
        """Why the worker group is being restarted; None while it is not RECOVERING."""
        return self.reason if self.state is EngineState.RECOVERING else None

    @property
    def draining(self) -> bool:
        """Whether new requests are refused while those in flight finish."""
        return self.state is EngineState.DRAINING

    async def wait_changed(self) -> None:
        """Returns at the next transition (the loop waits here while RECOVERING)."""
        self.changed.clear()
        await self.changed.wait()

    async def wait_for_work(self) -> None:
        """Returns at the next wakeup: a new request or a transition."""
        self.wakeup.clear()
        await self.wakeup.wait()
