"""How a leader stops: SIGINT, SIGTERM, a fatal engine error, a lost group or a lost node.

The order matters: health NOT_SERVING first, then the public port stops (gRPC's ``stop(grace)``: it takes no
new call from then on, on new or open connections, health checks on it included, which get UNAVAILABLE) and
in-flight RPCs get ``--shutdown-grace-seconds`` to finish; only ``--health-port``, a server of its own, answers
NOT_SERVING during the grace (load balancers and probes stop sending); then the other nodes are told (exit 0 for
an orderly stop, 1 for a failure) and every local rank is stopped (SIGTERM, then SIGKILL
after :data:`launch.local_ranks.WORKER_EXIT_SECONDS`); nothing is left behind. The process
exits non-zero unless it was an orderly stop. With ``--kv-transfer-config`` the ``tpserve.v1``
streams move at once, their KV held for the replica they continue on, and the ranks stop only
once those holds ended (coordinator/kv_transfer/stream_moves.py).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from coordinator.errors import UnavailableError
from launch.group_launcher import NODES_GOODBYE_SECONDS, GroupLauncher
from launch.local_ranks import WORKER_EXIT_SECONDS
from tpserve.config import ServerConfig

if TYPE_CHECKING:
    from coordinator.engine import Engine
    from launch.public_server import PublicServer

log = structlog.get_logger(__name__)

#: Seconds in-flight RPCs get to finish on shutdown (--shutdown-grace-seconds' default).
SHUTDOWN_GRACE_SECONDS = ServerConfig.model_fields["shutdown_grace_seconds"].default
#: Longest shutdown with the default grace: the RPC grace, the nodes' goodbye, then the ranks' SIGTERM grace.
#: Kubernetes' terminationGracePeriodSeconds must exceed it (tests/cluster/test_k8s.py).
DRAIN_SECONDS = SHUTDOWN_GRACE_SECONDS + NODES_GOODBYE_SECONDS + WORKER_EXIT_SECONDS
#: The last share of the grace in which the requests still running are failed with UNAVAILABLE saying why,
#: so that their statuses go out before gRPC cancels what is left at the grace's end.
GRACE_CUT_SHARE = 0.05


class Shutdown:
    """The leader's stop request (safe from signal handlers and callbacks) and its exit code."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self.exit_code = 0

    def stop(self, exit_code: int = 0) -> None:
        """Asks the leader to shut down; the first non-zero code wins."""
        self.exit_code = self.exit_code or exit_code
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def wait(self) -> None:
        await self._stop.wait()

    def install_signal_handlers(self, reload: Callable[[], None]) -> None:
        """SIGINT and SIGTERM stop with a drain; SIGHUP calls ``reload`` (never the default: that kills
        without a drain). Call from the running loop."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.stop)
        loop.add_signal_handler(signal.SIGHUP, reload)

    async def drain(self, public: PublicServer, engine: Engine | None, grace_s: float,
                    tasks: list[asyncio.Task | None], launcher: GroupLauncher) -> None:
        """Stops everything in order (see the module docstring); ``tasks``: background tasks to cancel."""
        await public.set_serving(False)
        cut = None
        if engine is not None:
            engine.drain()
            await public.move_streams_out()  # with --kv-transfer-config: streams move now, with their KV
            # The requests still running when the grace ends get a status that says why, just before gRPC
            # cancels every call left with its own "Cancelling all calls".
            cut = asyncio.get_running_loop().call_later(
                grace_s * (1 - GRACE_CUT_SHARE), engine.active.fail,
                f"the server shut down: its --shutdown-grace-seconds ({grace_s:g} s) ended before the request did; "
                "retry it on another replica", UnavailableError)
        await public.stop(grace_s)
        if cut is not None:
            cut.cancel()
        await public.kv_holds_ended()  # the ranks serve the holds' pulls until they end
        for task in tasks:
            if task is not None:
                task.cancel()
        await launcher.shut_down(failed=self.exit_code != 0)
        public.close_grammars()
        log.info("stopped", exit_code=self.exit_code)
