"""The ranks' LoRA settings: the slot pool's size and the adapters resident from start-up (no torch here).

Built from ``--enable-lora``'s section (tpserve/lora_config.py) by worker/main.py; read by
worker/lora_adapters.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRASettings:
    """``--max-loras``, ``--max-lora-rank``, the adapters loaded at start-up, in slot order (slot ``i + 1``), and
    ``--max-cpu-loras`` (adapters kept in host memory, worker/lora_host_cache.py; None: ``max_loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    adapter_paths: tuple[str, ...] = ()
    max_cpu_loras: int | None = None

    @property
    def cpu_capacity(self) -> int:
        """The host cache's adapters: ``--max-cpu-loras``, default ``--max-loras`` (vLLM's)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} must be >= --max-loras {self.max_loras}")
        if len(self.adapter_paths) > self.max_loras:
            raise ValueError(f"{len(self.adapter_paths)} --lora-modules do not fit --max-loras {self.max_loras}")
