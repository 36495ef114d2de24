"""A stand-in for ``torch.cuda`` on machines without a GPU: device count, memory info, set_device.

Only the functions tpserve's start-up path calls are replaced (with pytest's
``monkeypatch``, undone after each test); no CUDA tensor is ever created, so
tests that use it run the real worker code up to the first kernel launch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

GIB = 1 << 30


@dataclass
class FakeCuda:
    """What the fake GPU reports, and what was asked of it.

    Attributes:
        num_gpus: ``device_count()``; ``is_available()`` is ``num_gpus > 0``.
        total, free: ``mem_get_info()`` in bytes (free as read after the profile).
        reserved: ``memory_reserved()``, bytes the caching allocator holds.
        peak: ``max_memory_allocated()`` since the last ``reset_peak_memory_stats()``.
        set_device_calls: ``(thread name, device)`` per ``set_device`` call.
        events: names of the memory calls in order.
    """

    num_gpus: int = 2
    total: int = 80 * GIB
    free: int = 20 * GIB
    reserved: int = 58 * GIB
    peak: int = 40 * GIB
    set_device_calls: list[tuple[str, torch.device]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    _current: threading.local = field(default_factory=threading.local)

    def current_device(self) -> torch.device | None:
        """The calling thread's current device (CUDA's is per thread); None before any set_device."""
        return getattr(self._current, "device", None)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: self.num_gpus > 0)
        monkeypatch.setattr(cuda, "device_count", lambda: self.num_gpus)
        monkeypatch.setattr(cuda, "set_device", self._set_device)
        monkeypatch.setattr(cuda, "mem_get_info", self._record("mem_get_info", lambda: (self.free, self.total)))
        monkeypatch.setattr(cuda, "memory_reserved", self._record("memory_reserved", lambda: self.reserved))
        monkeypatch.setattr(cuda, "max_memory_allocated", self._record("max_memory_allocated", lambda: self.peak))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self._record("reset_peak_memory_stats", lambda: None))
        monkeypatch.setattr(cuda, "empty_cache", self._record("empty_cache", lambda: None))
        monkeypatch.setattr(cuda, "synchronize", self._record("synchronize", lambda: None))
        return self

    def _set_device(self, device) -> None:
        self.set_device_calls.append((threading.current_thread().name, torch.device(device)))
        self._current.device = torch.device(device)

    def _record(self, name: str, answer):
        def call(*_args, **_kwargs):
            self.events.append(name)
            return answer()

        return call
