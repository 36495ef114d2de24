"""The Generation service's LoRA adapter methods: load, unload and list adapters while serving.

Operator-only when API keys have roles (coordinator/auth.py ``OPERATOR_METHODS``): an
adapter changes what every tenant may ask for and takes one of the shared slots. The
slots' bookkeeping is :class:`coordinator.lora_registry.LoRARegistry`; every rank reads
the adapter's files on a thread of its gRPC pool (:meth:`coordinator.worker_client.WorkerGroup.load_lora`),
so neither the coordinator's event loop nor the ranks' step loop waits on the disk. No torch.
"""

from __future__ import annotations

import grpc
import structlog

from coordinator.engine import Engine
from coordinator.errors import UnavailableError
from coordinator.lora_registry import LoRARegistry
from coordinator.worker_client import WorkerGroupError
from tpserve.v1 import generate_pb2 as pb

log = structlog.get_logger(__name__)


class LoRAAdminMethods:
    """Mixed into :class:`coordinator.server.GenerationServicer`, which sets ``loras`` and ``_check_loaded``."""

    loras: LoRARegistry

    def _check_loaded(self) -> Engine:  # pragma: no cover - the servicer's
        raise NotImplementedError

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoadLoRAAdapterResponse:
        """Reads ``request.path`` into a free slot on every rank, then serves it as ``request.name``
        (errors: :meth:`LoRARegistry.load`)."""
        engine = self._check_loaded()
        why = engine.lifecycle.recovering or engine.lifecycle.dead
        if why:  # the group's ranks are not there to read it (a restart reads the served ones again)
            raise UnavailableError(f"the worker group is down ({why}); retry once the server is SERVING")

        async def read(slot: int, path: str) -> None:
            try:
                await engine.loop.workers.load_lora(slot, path)
            except WorkerGroupError as exc:  # the group was lost meanwhile: the slot stays free
                raise UnavailableError(f"the worker group failed while it read the adapter: {exc}") from None

        adapter = await self.loras.load(request.name, request.path, read)
        log.info("lora adapter loaded", name=adapter.name, path=adapter.path, slot=adapter.slot)
        return pb.LoadLoRAAdapterResponse(slot=adapter.slot)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> pb.UnloadLoRAAdapterResponse:
        """Stops serving ``request.name`` (errors: :meth:`LoRARegistry.unload`). The ranks keep its weights
        until the next load into the slot overwrites them: no scheduled sequence names the slot meanwhile."""
        self._check_loaded()
        adapter = self.loras.unload(request.name)
        log.info("lora adapter unloaded", name=adapter.name, slot=adapter.slot)
        return pb.UnloadLoRAAdapterResponse()

    async def ListLoRAAdapters(self, request: pb.ListLoRAAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> pb.ListLoRAAdaptersResponse:
        """The adapters served now, by slot, with their requests in flight."""
        return pb.ListLoRAAdaptersResponse(
            adapters=[pb.LoRAAdapter(name=a.name, path=a.path, slot=a.slot, num_requests=a.requests)
                      for a in self.loras.served()],
            max_loras=self.loras.max_loras)
