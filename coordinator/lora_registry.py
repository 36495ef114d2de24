"""Which LoRA adapter each worker slot holds, and the requests using each (no torch).

The coordinator's side of adapters loaded and unloaded while serving (docs/design/models.md,
"Adapters loaded while serving"). One object, touched only on the event loop, so each
method is atomic: a request :meth:`acquire` s its adapter before it is validated and
:meth:`release` s it when its handler ends; :meth:`unload` refuses an adapter with
requests in flight (FAILED_PRECONDITION) rather than waiting for them, so an unload
answers at once and a stream under the adapter is never cut.

Each load gets a fresh **cache key** (``name`` plus a load serial), the identity its
requests' prefix-cache namespace is derived from (coordinator/cache_isolation.py): blocks
computed under an unloaded adapter, or under an earlier adapter loaded with the same name,
chain from another namespace and are never a hit again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from coordinator.errors import (AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, NotFoundError,
                                ResourceExhaustedError)

#: Longest adapter name accepted (it is a metric label and part of log lines).
MAX_LORA_NAME_LEN = 128


@dataclass
class LoadedAdapter:
    """An adapter served now: its worker ``slot`` (``1 .. max_loras``), ``path``, prefix-cache ``cache_key``
    and the ``requests`` naming it in flight."""

    name: str
    path: str
    slot: int
    cache_key: str
    requests: int = 0


class LoRARegistry:
    """Adapter names -> worker slots, for ``--max-loras`` slots.

    Args:
        max_loras: the slots (0: LoRA is off; every load is refused).
        adapters: ``(name, path)`` resident from start-up (``--lora-modules``), in slots 1, 2, ...
    """

    def __init__(self, max_loras: int, adapters: Sequence[tuple[str, str]] = ()) -> None:
        self.max_loras = max_loras
        self._serial = 0
        self._adapters: dict[str, LoadedAdapter] = {}
        self._reserved: dict[int, str] = {}  # slot -> the name being loaded into it
        self._dropped: dict[int, LoadedAdapter] = {}  # slot -> a dropped adapter whose requests have not all ended
        for slot, (name, path) in enumerate(adapters, start=1):
            self._adapters[name] = LoadedAdapter(name, path, slot, self._next_key(name))

    def _next_key(self, name: str) -> str:
        self._serial += 1
        return f"{name}#{self._serial}"

    def served(self) -> list[LoadedAdapter]:
        """The adapters served now, by slot."""
        return sorted(self._adapters.values(), key=lambda a: a.slot)

    def in_use(self) -> list[str]:
        """The names of the adapters with requests in flight. Safe from another thread (the metrics
        scrape): ``list()`` of a dict's values is one call under the GIL."""
        return [a.name for a in list(self._adapters.values()) if a.requests]

    def acquire(self, name: str) -> LoadedAdapter:
        """The adapter a request names, counted in flight until :meth:`release`.

        Raises:
            NotFoundError: ``name`` is not served (the message lists what is).
        """
        adapter = self._adapters.get(name)
        if adapter is None:
            served = ", ".join(sorted(self._adapters)) or (
                "none (start the server with --enable-lora)" if not self.max_loras else "none")
            raise NotFoundError(f"lora_name {name!r} is not a served adapter; served: {served}")
        adapter.requests += 1
        return adapter

    def release(self, adapter: LoadedAdapter) -> None:
        """A request that :meth:`acquire` d ``adapter`` has ended."""
        adapter.requests -= 1
        if not adapter.requests and self._dropped.get(adapter.slot) is adapter:
            del self._dropped[adapter.slot]  # its last request ended: the slot may take another adapter

    def drop(self, name: str) -> LoadedAdapter:
        """Stops serving ``name`` whatever is in flight (a restarted group could not read it again:
        launch/recovery.py fails its requests); its slot takes no other adapter until they have ended,
        so that none of them can run on another adapter's weights.

        Raises:
            KeyError: ``name`` is not served.
        """
        adapter = self._adapters.pop(name)
        if adapter.requests:
            self._dropped[adapter.slot] = adapter
        return adapter

    async def load(self, name: str, path: str, read: Callable[[int, str], Awaitable[None]]) -> LoadedAdapter:
        """Reserves a free slot, awaits ``read(slot, path)`` (every rank reads the adapter into it), then
        serves ``name`` from it; the slot is free again if ``read`` raises.

        Raises:
            FailedPreconditionError: LoRA is off.
            InvalidArgumentError: an empty or too long name or path; ``read`` 's ValueError (a bad adapter).
            AlreadyExistsError: ``name`` is served or being loaded.
            ResourceExhaustedError: every slot holds or is loading an adapter.
        """
        if not self.max_loras:
            raise FailedPreconditionError("LoRA adapters need a server started with --enable-lora")
        if not name or len(name) > MAX_LORA_NAME_LEN or any(c.isspace() for c in name):
            raise InvalidArgumentError(f"name must have 1 to {MAX_LORA_NAME_LEN} characters and no whitespace")
        if not path:
            raise InvalidArgumentError("path is empty")
        if name in self._adapters or name in self._reserved.values():
            raise AlreadyExistsError(f"lora adapter {name!r} is already served; unload it first")
        taken = {a.slot for a in self._adapters.values()} | set(self._reserved) | set(self._dropped)
        free = [slot for slot in range(1, self.max_loras + 1) if slot not in taken]
        if not free:
            raise ResourceExhaustedError(f"every one of the --max-loras {self.max_loras} adapter slots is taken; "
                                         "unload an adapter first", retry_pushback_ms=None)
        slot = free[0]
        self._reserved[slot] = name
        try:
            await read(slot, path)
        except ValueError as error:
            raise InvalidArgumentError(f"lora adapter {name!r}: {error}") from None
        finally:
            del self._reserved[slot]
        adapter = self._adapters[name] = LoadedAdapter(name, path, slot, self._next_key(name))
        return adapter

    def unload(self, name: str) -> LoadedAdapter:
        """Stops serving ``name``; its slot is free for the next load.

        Raises:
            NotFoundError: ``name`` is not served.
            FailedPreconditionError: requests naming it are in flight.
        """
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFoundError(f"lora adapter {name!r} is not served")
        if adapter.requests:
            raise FailedPreconditionError(f"lora adapter {name!r} has {adapter.requests} requests in flight; "
                                          "retry once they end")
        del self._adapters[name]
        return adapter
