"""``--enable-lora``'s configuration section (vLLM's flags): the adapters served and their slot pool.

No torch here: the coordinator reads it (adapter name -> slot) and so do the ranks (slot -> path).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoRAConfig(BaseModel):
    """Multi-LoRA serving (worker/lora_adapters.py, worker/layers/lora.py).

    Attributes:
        enable_lora: serve LoRA adapters beside the base model (``--enable-lora``).
        lora_modules: ``name=path`` per adapter (``--lora-modules``), a PEFT directory
            (``adapter_config.json`` + ``adapter_model.safetensors``); the ``i``-th is resident in
            slot ``i + 1`` from start-up. A request names its adapter by ``name`` (``lora_name``).
        max_loras: adapter slots resident at once (``--max-loras``, vLLM's default 1). Every
            adapter of ``lora_modules`` must fit: adapters are not swapped in from host memory.
        max_lora_rank: the largest adapter rank ``r`` the slots hold (``--max-lora-rank``, default 16).
        max_cpu_loras: adapters each rank keeps in host memory after reading them (``--max-cpu-loras``,
            vLLM's; None: ``max_loras``), least recently loaded evicted first: reloading one is a copy,
            not a disk read (worker/lora_host_cache.py). At least ``max_loras``.

    Raises:
        ValueError: ``lora_modules`` without ``enable_lora``, an entry that is not ``name=path``,
            a name given twice, more adapters than ``max_loras``, or ``max_cpu_loras < max_loras``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = Field(1, ge=1, le=256)
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: int | None = Field(None, ge=1, le=4096)

    @model_validator(mode="after")
    def _check_modules(self) -> LoRAConfig:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        names = [name for name, _ in self.adapters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"lora_modules names {duplicates[0]!r} twice")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if len(names) > self.max_loras:
            raise ValueError(f"lora_modules has {len(names)} adapters; max_loras={self.max_loras} holds them all "
                             "resident (no swapping from host memory yet): raise max_loras")
        return self

    @property
    def adapters(self) -> tuple[tuple[str, str], ...]:
        """``(name, path)`` per adapter, in slot order (slot ``i + 1``).

        Raises:
            ValueError: an entry without ``=``, or with an empty name or path.
        """
        pairs = []
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entry {entry!r} is not name=path")
            pairs.append((name.strip(), path.strip()))
        return tuple(pairs)

    def slot_of(self) -> dict[str, int]:
        """Adapter name -> its resident slot (``1 .. max_loras``); empty without ``enable_lora``."""
        return {name: i for i, (name, _) in enumerate(self.adapters, start=1)} if self.enable_lora else {}
