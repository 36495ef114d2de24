"""The public port's health service: grpc_health's answers, with ``Watch`` streams that end when the drain does.

A ``Watch`` never ends by itself, and gRPC's graceful stop waits for every call: one health
watcher on the public port (a client's or a gateway's health checking, the gRPC convention)
held every SIGTERM for the whole ``--shutdown-grace-seconds``, on an idle server too (0.07 s
without it, 10.1 s with one watcher and a 10 s grace), so each rollout waited the grace per pod.
The drain ends them (:meth:`PublicHealth.close`) as the port stops: the client sees UNAVAILABLE
(after the NOT_SERVING the drain set at its start), which gRPC's client-side health checking reads
as unhealthy. ``--health-port`` serves the shared servicer itself, stopped
without a grace at the end. No torch.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


class PublicHealth(health_pb2_grpc.HealthServicer):
    """Delegates to ``servicer`` (the statuses both ports answer); :meth:`close` ends the watches.

    Args:
        servicer: the shared grpc_health servicer whose statuses are set (launch/public_server.py).
    """

    def __init__(self, servicer: health.aio.HealthServicer) -> None:
        self.servicer = servicer
        self._closing = asyncio.Event()

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - the gRPC method's name
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        return await self.servicer.Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - the gRPC method's name
                    context: grpc.aio.ServicerContext) -> None:
        """grpc_health's stream of status changes, until the drain closes it with UNAVAILABLE."""
        watch = asyncio.ensure_future(self.servicer.Watch(request, context))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((watch, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch, closing):
                task.cancel()
            await asyncio.gather(watch, closing, return_exceptions=True)
        if closing.done() and not closing.cancelled():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    def close(self) -> None:
        """Ends every Watch, now and from now on, with UNAVAILABLE."""
        self._closing.set()
