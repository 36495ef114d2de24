"""The coordinator's LoRA slots (coordinator/lora_registry.py): loads, unloads, refusals and cache keys."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.cache_isolation import prefix_cache_namespace
from coordinator.errors import (AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, NotFoundError,
                                ResourceExhaustedError)
from coordinator.lora_registry import LoRARegistry


def _load(registry: LoRARegistry, name: str, path: str, refuse: str | None = None) -> int:
    """``registry.load`` with a fake group read that records the slot (or refuses like a rank)."""
    read: list[tuple[int, str]] = []

    async def fake_read(slot: int, p: str) -> None:
        read.append((slot, p))
        await asyncio.sleep(0)
        if refuse:
            raise ValueError(refuse)

    adapter = asyncio.run(registry.load(name, path, fake_read))
    assert read == [(adapter.slot, path)]
    return adapter.slot


def test_slots_fill_free_and_refuse() -> None:
    registry = LoRARegistry(2, [("a", "/a")])
    assert [(a.name, a.slot) for a in registry.served()] == [("a", 1)]
    assert _load(registry, "b", "/b") == 2
    with pytest.raises(ResourceExhaustedError, match="every one of the --max-loras 2 adapter slots is taken"):
        _load(registry, "c", "/c")
    with pytest.raises(AlreadyExistsError, match="'a' is already served"):
        _load(registry, "a", "/a2")
    registry.unload("a")
    assert _load(registry, "c", "/c") == 1  # a's slot, free again
    with pytest.raises(NotFoundError, match="lora_name 'a' is not a served adapter; served: b, c"):
        registry.acquire("a")
    with pytest.raises(NotFoundError, match="lora adapter 'a' is not served"):
        registry.unload("a")


def test_a_refused_adapter_frees_its_slot_and_names_the_tensor() -> None:
    registry = LoRARegistry(1)
    with pytest.raises(InvalidArgumentError, match="lora adapter 'a': adapter tensor x.lora_A.weight: bad shape"):
        _load(registry, "a", "/bad", refuse="adapter tensor x.lora_A.weight: bad shape")
    assert registry.served() == [] and _load(registry, "a", "/good") == 1
    with pytest.raises(InvalidArgumentError, match="no whitespace"):
        _load(registry, "a b", "/x")


def test_in_flight_requests_block_the_unload() -> None:
    registry = LoRARegistry(1, [("a", "/a")])
    first, second = registry.acquire("a"), registry.acquire("a")
    assert first is second and first.requests == 2
    registry.release(first)
    with pytest.raises(FailedPreconditionError, match="'a' has 1 requests in flight"):
        registry.unload("a")
    registry.release(second)
    assert registry.unload("a").requests == 0


def test_a_reload_gets_a_new_prefix_cache_namespace() -> None:
    registry = LoRARegistry(1, [("a", "/a")])
    before = registry.acquire("a").cache_key
    registry.release(registry.served()[0])
    registry.unload("a")
    _load(registry, "a", "/a")
    after = registry.served()[0].cache_key
    assert before != after
    assert prefix_cache_namespace("", "", before) != prefix_cache_namespace("", "", after)


def test_lora_off_refuses_loads() -> None:
    with pytest.raises(FailedPreconditionError, match="--enable-lora"):
        _load(LoRARegistry(0), "a", "/a")
    with pytest.raises(NotFoundError, match="served: none \\(start the server with --enable-lora\\)"):
        LoRARegistry(0).acquire("a")


def test_a_dropped_adapter_holds_its_slot_until_its_requests_end() -> None:
    """An adapter a restarted group could not read again (launch/recovery.py) stops being served at once, but
    its slot takes no other adapter while a request of it is in flight: none may run on another's weights."""
    registry = LoRARegistry(1, [("a", "/a")])
    first, second = registry.acquire("a"), registry.acquire("a")
    assert registry.drop("a") is first and registry.served() == []
    with pytest.raises(NotFoundError, match="lora_name 'a' is not a served adapter"):
        registry.acquire("a")
    registry.release(first)
    with pytest.raises(ResourceExhaustedError, match="every one of the --max-loras 1 adapter slots is taken"):
        _load(registry, "b", "/b")
    registry.release(second)
    assert _load(registry, "b", "/b") == 1
    registry.drop("b")  # nothing in flight: the slot is free at once
    assert _load(registry, "c", "/c") == 1
