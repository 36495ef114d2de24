"""``--max-cpu-loras``: a host-memory LRU of adapters read from disk, so reloading one is a copy.

vLLM's flag: ``--max-loras`` adapters are resident in the model's slots (worker/layers/lora.py),
``--max-cpu-loras`` (default: ``--max-loras``) are kept in host memory after their first read.
An adapter loaded again into a slot (after an unload, or into another slot) is copied from
here: no file is opened, parsed, scaled or split. Each entry holds this rank's share of every
layer the adapter targets, in the slots' layout (``a (P * R, in_local)``, ``b (P * R, out_local)``,
the scaling folded in), so a hit is one ``copy_`` per adapted layer.

An entry is keyed by the directory's resolved path and its two files' sizes and modification
times: an adapter rewritten in place on disk is read again, never served stale. On a CPU rank the
slots are host memory too; the entries are separate copies that outlive an unload.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

#: The files an entry depends on (PEFT's layout).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

#: One adapter's share on this rank: adapted layer name -> (its slot's ``a``, its slot's ``b``).
HostAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]


def adapter_key(directory: str | Path) -> tuple:
    """The cache identity of the adapter at ``directory``: its resolved path and its files' ``(size, mtime_ns)``.

    Raises:
        OSError: a file is missing (the disk read then names it).
    """
    path = Path(directory).resolve()
    stats = [os.stat(path / name) for name in ADAPTER_FILES]
    return (str(path), *((s.st_size, s.st_mtime_ns) for s in stats))


class HostAdapterCache:
    """At most ``capacity`` adapters, least recently loaded evicted first. Thread-safe: the ``LoadLoRA``
    RPCs run on the rank's gRPC pool.

    Args:
        capacity: ``--max-cpu-loras`` (0 keeps nothing: every load reads the disk).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"--max-cpu-loras must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple, HostAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> HostAdapter | None:
        """The entry for ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: tuple, entry: HostAdapter) -> None:
        """Keep ``entry`` (tensors the cache owns: clones, never a slot's views), evicting the least recent."""
        if self.capacity == 0:
            return
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry (the next load of each adapter reads the disk)."""
        with self._lock:
            self._entries.clear()
