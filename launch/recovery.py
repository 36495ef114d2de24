"""A lost worker group: found (liveness), then restarted with its requests resumed, or failed.

A rank that exits, a node that leaves, a step that fails or a rank alive but stuck (SIGSTOP,
a hung kernel, a silent host) loses the group. With ``--worker-recovery-timeout-seconds``
the leader holds the requests (the engine suspends them), restarts every rank on every host
(:meth:`launch.group_launcher.GroupLauncher.restart`) and resumes them by recompute; without
it, or past the timeout, the requests fail with UNAVAILABLE and the leader exits 1 for the
orchestrator to restart it.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from coordinator.engine import Engine
from coordinator.errors import TpserveError, UnavailableError
from coordinator.metrics import Metrics
from coordinator.worker_client import WorkerGroupError
from launch.group_launcher import GroupLauncher
from launch.public_server import PublicServer
from launch.shutdown import Shutdown
from tpserve.config import ClusterConfig

log = structlog.get_logger(__name__)


class Recovery:
    """Restart-and-resume of one leader's group, and the liveness watch.

    Args:
        config: the cluster configuration (``--worker-recovery-timeout-seconds``).
        launcher: restarts the ranks.
        public: its health turns NOT_SERVING while the group restarts.
        metrics: counts restarts and resumed requests.
        shutdown: stops the leader (exit 1) when the group cannot come back.

    Attributes:
        engine: the engine whose requests are held and resumed, once started.
    """

    def __init__(self, config: ClusterConfig, launcher: GroupLauncher, public: PublicServer, metrics: Metrics,
                 shutdown: Shutdown) -> None:
        self.config = config
        self.launcher = launcher
        self.public = public
        self.metrics = metrics
        self.shutdown = shutdown
        self.engine: Engine | None = None
        self._liveness_task: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None

    def watch_liveness(self) -> None:
        """Starts the watch that fails a group whose rank is alive but stuck (its requests could
        only hang, so they fail with UNAVAILABLE at once) or gone between two steps' reads (they
        fail with INTERNAL, a worker failure, whichever detector sees it first); or the group restarts."""
        self._liveness_task = asyncio.create_task(self._watch_liveness())

    async def _watch_liveness(self) -> None:
        loss = await self.launcher.workers.watch_liveness()
        self.group_failed(loss.reason, UnavailableError if loss.stuck else TpserveError)

    def group_failed(self, reason: str, error: type[TpserveError] = TpserveError) -> bool:
        """A rank or a node is lost. With --worker-recovery-timeout-seconds, restart the
        group (on every host) and resume the requests (returns True); otherwise fail the
        requests in flight at once and stop (exit 1; returns False)."""
        if self._recovery is not None:
            return True  # already restarting: the other detectors see the same loss
        if self._can_recover():
            # Hold the requests now, before anything else runs: the engine loop must
            # not schedule another step on the lost group.
            resumed = self.engine.suspend(reason)
            self._recovery = asyncio.create_task(self._recover(reason, resumed))
            return True
        log.error("worker group lost", reason=reason)
        if self.engine is not None and not self.engine.dead:
            self.engine.fail_all(reason, error)
        self.shutdown.stop(1)
        return False

    def _can_recover(self) -> bool:
        return (self.config.server.worker_recovery_timeout_seconds > 0
                and self.engine is not None and not self.engine.dead and not self.shutdown.stopping)

    async def _recover(self, reason: str, resumed: int) -> None:
        """Restarts every rank and resumes the (suspended) requests by recompute, or fails
        them (UNAVAILABLE) and exits 1. ``resumed``: running sequences to recompute.

        With ``--nnodes`` > 1 a lost host (its registry link dropped, or one of its ranks
        failed) pauses the group rather than ending it: every rank on every host stops (a
        torch.distributed group is whole or nothing), the registry takes joins again, and
        once every node has joined (its pod or ``--headless`` process started again) all
        ranks start on a fresh rendezvous (a new rank 0 store)."""
        timeout_s = self.config.server.worker_recovery_timeout_seconds
        log.error("worker group lost; restarting it", reason=reason, timeout_s=timeout_s)
        started = time.monotonic()
        await self.public.set_serving(False)
        if self._liveness_task is not None and self._liveness_task is not asyncio.current_task():
            self._liveness_task.cancel()
        await self.launcher.stop_ranks()
        try:
            deadline = started + timeout_s
            available = await self.launcher.restart(reason, deadline, timeout_s)
            num_blocks = self.engine.scheduler.allocator.num_blocks
            if available < num_blocks:
                raise WorkerGroupError(f"the restarted ranks hold {available} KV blocks, the pool had {num_blocks}")
            await asyncio.wait_for(self.launcher.workers.start(num_blocks), max(deadline - time.monotonic(), 0.1))
        except (WorkerGroupError, asyncio.TimeoutError, OSError) as exc:
            message = f"the worker group was lost ({reason}) and could not be restarted within {timeout_s:g} s: {exc}"
            log.error("worker group recovery failed", error=message)
            self._recovery = None
            self.engine.fail_all(message, UnavailableError)
            return
        self.watch_liveness()
        self.engine.resume(self.launcher.workers)
        self._recovery = None
        self.metrics.worker_restarts.inc()
        self.metrics.requests_resumed.inc(resumed)
        await self.public.set_serving(True)
        log.info("worker group restarted", seconds=round(time.monotonic() - started, 3), requests_resumed=resumed)

    @property
    def tasks(self) -> list[asyncio.Task | None]:
        """The liveness watch and a restart in progress, for the shutdown to cancel."""
        return [self._liveness_task, self._recovery]
