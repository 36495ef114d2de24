"""The ranks' LoRA settings: the slot pool's size and the adapters resident from start-up (no torch here).

Built from ``--enable-lora``'s section (tpserve/lora_config.py) by worker/main.py; read by
worker/lora_adapters.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRASettings:
    """``--max-loras``, ``--max-lora-rank`` and the adapters loaded at start-up, in slot order (slot ``i + 1``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    adapter_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if len(self.adapter_paths) > self.max_loras:
            raise ValueError(f"{len(self.adapter_paths)} --lora-modules do not fit --max-loras {self.max_loras}")
