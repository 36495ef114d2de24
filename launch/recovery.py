"""A lost worker group: found (liveness), then restarted with its requests resumed, or failed.

A rank that exits, a node that leaves, a step that fails or a rank alive but stuck (SIGSTOP,
a hung kernel, a silent host) loses the group. With ``--worker-recovery-timeout-seconds``
the leader holds the requests (the engine suspends them), restarts every rank on every host
(:meth:`launch.group_launcher.GroupLauncher.restart`) and resumes them by recompute; without
it, or past the timeout, the requests fail with UNAVAILABLE and the leader exits 1 for the
orchestrator to restart it.

A restart can itself fail: a replacement rank killed or crashing while the group loads, a node
lost again. That is seen at once (the ranks' monitor, the node registry) and the restart is
tried again, up to :data:`MAX_RESTART_ATTEMPTS` times within the timeout, each failure logged
with the rank, the host and the cause; a restart that cannot succeed (a rank reports a load
error) or the last failed attempt fails the requests within seconds with that cause, not at
the end of the timeout with an empty reason (docs/design/faults.md, "A second failure during a restart").
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

#: Restarts tried for one loss (within --worker-recovery-timeout-seconds) before the leader gives up.
MAX_RESTART_ATTEMPTS = 3
#: Seconds between a failed restart attempt (its ranks stopped) and the next.
RESTART_BACKOFF_SECONDS = 1.0


class RestartFailed(Exception):
    """A restart attempt that failed; ``retry``: whether another attempt may succeed (a rank or a
    node lost while the group loaded) or not (a rank's load error, the deadline)."""

    def __init__(self, cause: str, retry: bool) -> None:
        super().__init__(cause)
        self.retry = retry


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
        self._attempt_lost: asyncio.Future[str] | None = None  # a restart attempt's loss, while one runs

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
            # Already restarting: the other detectors see the same loss, or a rank or node of the
            # restarting group is lost (the attempt fails now, not at the end of the timeout).
            if self._attempt_lost is not None and not self._attempt_lost.done():
                self._attempt_lost.set_result(reason)
            return True
        if self._can_recover():
            # Hold the requests now, before anything else runs: the engine loop must
            # not schedule another step on the lost group.
            resumed = self.engine.suspend(reason)
            self._recovery = asyncio.create_task(self._recover(reason, resumed))
            return True
        log.error("worker group lost", reason=reason)
        if self.engine is not None and not self.engine.lifecycle.dead:
            self.engine.fail_all(reason, error)
        self.shutdown.stop(1)
        return False

    def _can_recover(self) -> bool:
        return (self.config.server.worker_recovery_timeout_seconds > 0
                and self.engine is not None and not self.engine.lifecycle.dead and not self.shutdown.stopping)

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
        deadline = started + timeout_s
        for attempt in range(1, MAX_RESTART_ATTEMPTS + 1):
            try:
                await self._restart_once(reason, deadline, timeout_s)
                break
            except RestartFailed as exc:
                cause = f"{exc} (restart attempt {attempt} of {MAX_RESTART_ATTEMPTS})"
                retry = exc.retry and attempt < MAX_RESTART_ATTEMPTS and \
                    deadline - time.monotonic() > RESTART_BACKOFF_SECONDS
                if retry:
                    log.warning("worker group restart attempt failed; trying again", cause=cause,
                                seconds_left=round(deadline - time.monotonic(), 1))
                await self.launcher.stop_ranks()
                if not retry:
                    self._fail(reason, timeout_s, started, cause)
                    return
                await asyncio.sleep(RESTART_BACKOFF_SECONDS)
        if not await self._restore_lora_adapters(reason, timeout_s, started):
            return
        self.watch_liveness()
        self.engine.resume(self.launcher.workers)
        self._recovery = None
        self.metrics.worker_restarts.inc()
        self.metrics.requests_resumed.inc(resumed)
        await self.public.set_serving(True)
        log.info("worker group restarted", seconds=round(time.monotonic() - started, 3), requests_resumed=resumed)

    async def _restart_once(self, reason: str, deadline: float, timeout_s: float) -> None:
        """One restart attempt: every rank started again, loaded, and its KV cache allocated.

        Raises:
            RestartFailed: with the cause (never empty): a rank or node lost while the group loaded
                (may be retried), or a load error, a smaller pool, the deadline (not retried).
        """
        loop = asyncio.get_running_loop()
        self._attempt_lost = lost = loop.create_future()
        attempt = asyncio.create_task(self._start_group(reason, deadline, timeout_s))
        try:
            # The inner steps give up at the deadline with their own reasons; this one only if they do not.
            done, _ = await asyncio.wait({attempt, lost}, timeout=max(deadline - time.monotonic(), 0.0) + 5.0,
                                         return_when=asyncio.FIRST_COMPLETED)
            if lost in done:
                raise RestartFailed(f"while the group restarted, {lost.result()}", retry=True)
            if attempt not in done:
                raise RestartFailed("the restarted ranks neither loaded nor failed by the deadline", retry=False)
            exc = attempt.exception()
            if exc is None:
                return
            if isinstance(exc, (WorkerGroupError, OSError, asyncio.TimeoutError)):
                raise RestartFailed(str(exc) or f"{type(exc).__name__} while the ranks restarted", retry=False)
            raise exc
        finally:
            self._attempt_lost = None
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)

    async def _start_group(self, reason: str, deadline: float, timeout_s: float) -> None:
        """Starts every rank again and allocates the pool the engine had, and its host tier.

        The replacement ranks' host slots are empty: the engine's suspend already forgot the blocks its
        tier named (:meth:`coordinator.scheduler.Scheduler.reset_workers`), so no look-up finds one.
        """
        available = await self.launcher.restart(reason, deadline, timeout_s)
        num_blocks = self.engine.scheduler.allocator.num_blocks
        if available < num_blocks:
            raise WorkerGroupError(f"the restarted ranks hold {available} KV blocks, the pool had {num_blocks}")
        try:
            slots = self.engine.scheduler.state_slots  # a hybrid's state pool: the same size again
            # The host tier too: the coordinator still plans copies to and from it, and a rank without one
            # fails every such step (and each failure restarted the group again).
            tier = self.engine.scheduler.kv_cache.host_tier
            await asyncio.wait_for(self.launcher.workers.start(num_blocks, slots.num_slots if slots else 0,
                                                               tier.num_slots if tier else 0),
                                   max(deadline - time.monotonic(), 0.1))
        except asyncio.TimeoutError:
            raise WorkerGroupError("the restarted ranks did not allocate their KV cache by the deadline") from None

    async def _restore_lora_adapters(self, reason: str, timeout_s: float, started: float) -> bool:
        """Has the restarted ranks read every adapter served now into its slot again: they start with
        ``--lora-modules``' only, and an adapter loaded while serving (coordinator/lora_admin.py) would
        otherwise run as the base model. An adapter whose files can no longer be read (moved, deleted,
        rewritten invalid since it was loaded) is dropped: its requests fail with UNAVAILABLE naming it, a
        request naming it later gets NOT_FOUND, and the base model and every other adapter serve on. False
        (the group failed, :meth:`_fail`) when the ranks themselves fail while they read one."""
        servicer = self.public.servicer
        for adapter in servicer.loras.served() if servicer is not None else ():
            try:
                await self.launcher.workers.load_lora(adapter.slot, adapter.path)
            except ValueError as exc:
                servicer.loras.drop(adapter.name)
                cause = (f"LoRA adapter {adapter.name!r} could not be read again after the worker group restarted "
                         f"and is no longer served: {exc}")
                failed = self.engine.active.fail(cause, UnavailableError, lora_slot=adapter.slot)
                log.error("lora adapter dropped", name=adapter.name, slot=adapter.slot, path=adapter.path,
                          error=str(exc), requests_failed=failed)
            except WorkerGroupError as exc:
                await self.launcher.stop_ranks()
                self._fail(reason, timeout_s, started, f"LoRA adapter {adapter.name!r} could not be read again: {exc}")
                return False
        return True

    def _fail(self, reason: str, timeout_s: float, started: float, cause: str) -> None:
        """The restart failed: the held requests fail with UNAVAILABLE naming ``cause``, and the leader exits 1.

        The message gives the seconds the recovery took (since ``started``, ``time.monotonic()``) beside the
        timeout: a load error ends it in seconds, long before ``timeout_s``, and "within 120 s" would point
        an operator at the timeout instead of the cause."""
        message = (f"the worker group was lost ({reason}) and could not be restarted (gave up after "
                   f"{time.monotonic() - started:.1f} s; --worker-recovery-timeout-seconds {timeout_s:g}): {cause}")
        log.error("worker group recovery failed", error=message)
        self._recovery = None
        self.engine.fail_all(message, UnavailableError)

    @property
    def tasks(self) -> list[asyncio.Task | None]:
        """The liveness watch and a restart in progress, for the shutdown to cancel."""
        return [self._liveness_task, self._recovery]
