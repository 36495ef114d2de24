"""The Generation service's LoRA methods against a lost worker group (coordinator/lora_admin.py).

The served path (load, use, unload, reload through ``tpserve serve``) is tests/e2e/test_lora_load_unload.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from coordinator.engine.lifecycle import Lifecycle
from coordinator.engine_state import EngineState
from coordinator.errors import UnavailableError
from coordinator.lora_admin import LoRAAdminMethods
from coordinator.lora_registry import LoRARegistry
from coordinator.worker_client import WorkerGroupError
from tpserve.v1 import generate_pb2 as pb


class _Servicer(LoRAAdminMethods):
    def __init__(self, load_lora) -> None:
        self.loras = LoRARegistry(1)
        self.engine = SimpleNamespace(lifecycle=Lifecycle(), loop=SimpleNamespace(
            workers=SimpleNamespace(load_lora=load_lora)))

    def _check_loaded(self):
        return self.engine


def _load(servicer: _Servicer) -> pb.LoadLoRAAdapterResponse:
    return asyncio.run(servicer.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(name="a", path="/a"), None))


def test_a_group_lost_during_the_read_is_unavailable_and_frees_the_slot() -> None:
    async def lost(slot: int, path: str) -> None:
        raise WorkerGroupError("LoadLoRA: UNAVAILABLE: rank 1 closed")

    servicer = _Servicer(lost)
    with pytest.raises(UnavailableError, match="the worker group failed while it read the adapter: LoadLoRA"):
        _load(servicer)
    assert servicer.loras.served() == []

    async def read(slot: int, path: str) -> None:
        return None

    servicer.engine.loop.workers.load_lora = read
    assert _load(servicer).slot == 1  # the slot was free again


def test_a_restarting_group_refuses_loads() -> None:
    async def never(slot: int, path: str) -> None:
        raise AssertionError("no rank is asked while the group restarts")

    servicer = _Servicer(never)
    servicer.engine.lifecycle.enter(EngineState.RECOVERING, "rank 1 closed its stream")
    with pytest.raises(UnavailableError, match=r"the worker group is down \(rank 1 closed its stream\)"):
        _load(servicer)
