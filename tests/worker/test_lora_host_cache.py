"""``--max-cpu-loras``: adapters kept in host memory after their first read (worker/lora_host_cache.py).

On the tiny Llama with a pool of 2 slots: an adapter loaded again (into another slot, after another
took its slot) is copied from host memory without opening a file, and the slot then holds exactly
what a read from disk puts there; the least recently loaded adapter is evicted past the capacity;
an adapter rewritten on disk is read again; ``--max-cpu-loras`` below ``--max-loras`` is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import worker.lora_adapters as lora_adapters
from tests.tiny_models import TINY_MODELS, save_tiny_model
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter
from worker.lora_host_cache import HostAdapterCache
from worker.lora_settings import LoRASettings
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

ADAPTERS = (
    AdapterSpec("all_r4", 4, 8.0, ALL_TARGETS, seed=51),
    AdapterSpec("qv_r8", 8, 16.0, ("q_proj", "v_proj"), seed=52),
    AdapterSpec("o_down_r2", 2, 4.0, ("o_proj", "down_proj"), seed=53),
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("lora_host_cache")
    spec = next(s for s in TINY_MODELS if s.name == "gqa_tied")
    base = save_tiny_model(spec, root / spec.name)
    paths = [root / a.name for a in ADAPTERS]
    for adapter, path in zip(ADAPTERS, paths, strict=True):
        save_adapter(base, adapter, path)
    return base, paths


def _slots(runner: ModelRunner, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    lora = runner.lora
    assert lora is not None
    return {name: (layer.lora.a[slot - 1].clone(), layer.lora.b[slot - 1].clone())
            for name, layer in lora.layers.items()}


def _equal(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k][0], y[k][0]) and torch.equal(x[k][1], y[k][1]) for k in x)


def test_reload_is_a_host_copy_equal_to_a_disk_read(setup: tuple[Path, list[Path]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    base, (a, b, _) = setup
    runner = ModelRunner(base, ParallelContext.single(), torch.float32, 4, lora=LoRASettings(2, 8))
    adapters = runner.lora
    assert adapters is not None and adapters.host_cache.capacity == 2  # default: --max-loras
    assert adapters.load(1, a) is False  # first read: from disk
    from_disk = _slots(runner, 1)
    assert adapters.load(1, b) is False  # b takes slot 1
    assert adapters.load(2, b) is True  # b again, into slot 2: from host memory

    def no_disk(*args: object, **kwargs: object) -> None:
        raise AssertionError("a host-cache hit opened the adapter's file")

    monkeypatch.setattr(lora_adapters, "safe_open", no_disk)
    assert adapters.load(1, a) is True  # a back into slot 1, no file opened
    monkeypatch.undo()
    assert _equal(_slots(runner, 1), from_disk)
    assert _equal(_slots(runner, 2), _slots_after_disk_read(base, b))


def _slots_after_disk_read(base: Path, path: Path) -> dict:
    runner = ModelRunner(base, ParallelContext.single(), torch.float32, 4, lora=LoRASettings(1, 8, (str(path),)))
    return _slots(runner, 1)


def test_least_recently_loaded_is_evicted_and_rewritten_files_are_read(setup: tuple[Path, list[Path]]) -> None:
    base, (a, b, c) = setup
    runner = ModelRunner(base, ParallelContext.single(), torch.float32, 4,
                         lora=LoRASettings(1, 8, max_cpu_loras=2))
    adapters = runner.lora
    assert adapters is not None
    assert [adapters.load(1, p) for p in (a, b, a, c)] == [False, False, True, False]  # c evicts b, not a
    assert len(adapters.host_cache) == 2
    assert adapters.load(1, a) is True and adapters.load(1, b) is False  # b was evicted: read again
    stat = os.stat(a / "adapter_model.safetensors")  # rewritten in place: a new modification time
    os.utime(a / "adapter_model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert adapters.load(1, a) is False


def test_max_cpu_loras_below_max_loras_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-cpu-loras 1 must be >= --max-loras 2"):
        LoRASettings(2, 8, max_cpu_loras=1)
    with pytest.raises(ValueError, match="--max-cpu-loras must be >= 0"):
        HostAdapterCache(-1)
    cache = HostAdapterCache(0)  # keeps nothing
    cache.put(("x",), {})
    assert len(cache) == 0 and cache.get(("x",)) is None
