"""PEFT LoRA adapters read from disk into a model's resident slots (the math: worker/layers/lora.py).

An adapter directory holds ``adapter_config.json`` (peft's ``LoraConfig``: ``r``,
``lora_alpha``, ``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors``
with ``base_model.model.<module>.lora_A.weight (r, in)`` and ``.lora_B.weight (out, r)``
per adapted module (peft's ``get_peft_model_state_dict`` names). ``<module>`` is the
checkpoint's module name (``model.layers.3.self_attn.q_proj``); the model's
``stacked_params_mapping`` maps it to a fused layer and its part (``qkv_proj``, ``"q"``),
whose ``weight_loader`` splits ``B``'s rows for this rank exactly as it splits ``W``'s.

Served: the attention and MLP projections of the Llama-layout families (``q/k/v/o_proj``,
``gate/up/down_proj``, and checkpoints that store ``qkv_proj`` / ``gate_up_proj`` fused), and
of the mixture-of-experts families (Mixtral, Qwen3-MoE, ...) the attention projections and
the dense MLPs' (and shared experts') projections.
Refused at load with one line: ``modules_to_save``, a LoRA bias, DoRA, per-module rank or
alpha patterns, ``target_parameters`` (peft's LoRA on the routed experts' fused weights),
a rank above ``--max-lora-rank``, a module the model lacks (a routed expert's included),
and a tensor whose shape does not match the base model (each naming the field or tensor).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import nn

from worker.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.lora import LoRAStep, LoRAWeights
from worker.lora_host_cache import HostAdapter, HostAdapterCache, adapter_key
from worker.lora_settings import LoRASettings
from worker.parallel_state import ParallelContext

#: The modules an adapter may target, by the model's (fused) layer name.
TARGET_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."
_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` that change the maths: rank and ``scaling``."""

    r: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (peft's LoraLayer.update_layer)


def check_lora_supported(device_type: str, draft_model: bool, pp_size: int) -> None:
    """Refuse, in one line, what ``--enable-lora`` does not combine with yet.

    Raises:
        ValueError: CUDA ranks (the low-rank paths have no Triton kernel, and CUDA graphs would
            not see the step's adapter rows), a draft model (its proposals would not be verified
            under the request's adapter), or pipeline stages.
    """
    if device_type == "cuda":
        raise ValueError("--enable-lora is not supported on CUDA yet (no Triton LoRA kernel); serve on CPU ranks")
    if draft_model:
        raise ValueError("--enable-lora is not supported with speculative decoding (--speculative-model)")
    if pp_size > 1:
        raise ValueError("--enable-lora is not supported with --pipeline-parallel-size > 1")


def read_adapter_config(directory: str | Path, max_rank: int) -> AdapterConfig:
    """Parse and check ``directory/adapter_config.json``.

    Raises:
        ValueError: not a LoRA adapter, a field this server does not serve, or ``r > max_rank``
            (one line naming the field and the file).
    """
    path = Path(directory) / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read the adapter config ({error})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type={config['peft_type']!r}; only LORA adapters are served")
    if config.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save={config['modules_to_save']!r} is not supported "
                         "(full copies of modules per adapter); only low-rank target_modules are served")
    if config.get("target_parameters"):
        raise ValueError(f"{path}: target_parameters={config['target_parameters']!r} is not supported (LoRA on "
                         "the routed MoE experts' fused weights); target the attention and dense MLP modules")
    targets = config.get("target_modules") or ()
    for head in ("lm_head", "embed_tokens"):  # peft saves a full copy of such a base weight beside the A and B
        if head in (targets if isinstance(targets, list) else str(targets)):
            raise ValueError(f"{path}: target_modules includes {head!r}: LoRA on the embedding and the output head "
                             "is not served; target the attention and MLP projections")
    for field_name, unsupported in (("bias", lambda v: v not in (None, "none")), ("use_dora", bool),
                                    ("rank_pattern", bool), ("alpha_pattern", bool)):
        if unsupported(config.get(field_name)):
            raise ValueError(f"{path}: {field_name}={config[field_name]!r} is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{path}: r={r!r} must be a positive integer")
    if r > max_rank:
        raise ValueError(f"{path}: r={r} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"{path}: lora_alpha={alpha!r} must be a number")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return AdapterConfig(r, float(scaling))


class LoRAAdapters:
    """The model's adapter slots: attaches :class:`~worker.layers.lora.LoRAWeights` to every target layer.

    Args:
        model: the loaded model (a :class:`~worker.models.base.CausalLM`).
        settings: the pool's size and the adapters to load now.
        ctx: this rank's tensor-parallel group.
        dtype: activation dtype (the slots' dtype).

    Raises:
        ValueError: the model has no layer an adapter can target (its family's name in the
            message), or an adapter of ``settings`` is refused (:meth:`load`).
    """

    def __init__(self, model: nn.Module, settings: LoRASettings, ctx: ParallelContext, dtype: torch.dtype) -> None:
        self.model = model
        self.settings = settings
        self.ctx = ctx
        self.step = LoRAStep(ctx.device)
        self.host_cache = HostAdapterCache(settings.cpu_capacity)  # --max-cpu-loras (worker/lora_host_cache.py)
        self.layers: dict[str, ColumnParallelLinear | RowParallelLinear] = {}
        for name, module in model.named_modules():
            if name.rpartition(".")[2] not in TARGET_LAYERS:
                continue
            if isinstance(module, RowParallelLinear):
                widths, in_features, out_features = [module.output_size], module.input_size_per_partition, \
                    module.output_size
            elif isinstance(module, ColumnParallelLinear):
                widths = ([module.q_size, module.kv_size, module.kv_size] if isinstance(module, QKVParallelLinear)
                          else [size // ctx.tp_size for size in module.output_sizes]
                          if isinstance(module, MergedColumnParallelLinear) else [module.output_size_per_partition])
                in_features, out_features = module.input_size, module.output_size_per_partition
            else:
                continue
            module.lora = LoRAWeights(self.step, len(widths), settings.max_loras, settings.max_lora_rank,
                                      in_features, out_features, dtype, ctx.device, widths)
            self.layers[name] = module
        if not self.layers:
            raise ValueError(f"--enable-lora: {type(model).__name__} has no layer LoRA adapters can target "
                             f"(served: {', '.join(TARGET_LAYERS)} of the Llama-layout families)")
        self._stacked = {checkpoint: (fused, shard)
                         for fused, checkpoint, shard in getattr(model, "stacked_params_mapping", ())}
        for slot, path in enumerate(settings.adapter_paths, start=1):
            self.load(slot, path)

    def load(self, slot: int, directory: str | Path) -> bool:
        """Put the adapter at ``directory`` into ``slot`` (``1 .. max_loras``), replacing what it held: a copy
        from the host cache (``--max-cpu-loras``) when it holds these files, else a read from disk (then kept).

        Returns:
            Whether the adapter came from host memory.

        Raises:
            ValueError: a refused config field (:func:`read_adapter_config`), a tensor naming a module
                the model lacks, a shape that does not match the base model, or a corrupt file (each
                naming the tensor or file); the slot is then empty.
        """
        if not 1 <= slot <= self.settings.max_loras:
            raise ValueError(f"lora slot {slot} outside [1, {self.settings.max_loras}]")
        try:
            key: tuple | None = adapter_key(directory)
        except OSError:
            key = None  # a missing file: the disk read below names it
        entry = None if key is None else self.host_cache.get(key)
        if entry is not None:
            self._copy_in(slot - 1, entry)
            return True
        touched = self._read(slot, directory)
        if key is not None:
            self.host_cache.put(key, {name: (self.layers[name].lora.a[slot - 1].clone(),  # type: ignore[union-attr]
                                             self.layers[name].lora.b[slot - 1].clone())  # type: ignore[union-attr]
                                      for name in touched})
        return False

    def _copy_in(self, index: int, entry: HostAdapter) -> None:
        """Slot ``index`` from a host cache entry: its layers' ``a`` and ``b`` copied, every other layer's cleared."""
        for name, layer in self.layers.items():
            lora = layer.lora
            assert lora is not None
            if name in entry:
                lora.a[index].copy_(entry[name][0])
                lora.b[index].copy_(entry[name][1])
            else:
                lora.clear(index)

    def _read(self, slot: int, directory: str | Path) -> set[str]:
        """Read, check and split the adapter's files into ``slot``; returns the names of the layers it adapts."""
        config = read_adapter_config(directory, self.settings.max_lora_rank)
        touched: set[str] = set()
        for layer in self.layers.values():
            layer.lora.clear(slot - 1)  # type: ignore[union-attr]
        path = Path(directory) / "adapter_model.safetensors"
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
                for name in names:
                    if name.endswith(".lora_A.weight"):
                        module = name[:-len(".lora_A.weight")]
                        b_name = f"{module}.lora_B.weight"
                        if b_name not in names:
                            raise ValueError(f"{path}: {name} has no {b_name}")
                        touched.add(self._load_module(slot - 1, module, f.get_tensor(name), f.get_tensor(b_name),
                                                      config, name))
                    elif not name.endswith(".lora_B.weight"):
                        raise ValueError(f"{path}: tensor {name} is not a LoRA A or B matrix")
        except ValueError:
            for layer in self.layers.values():
                layer.lora.clear(slot - 1)  # type: ignore[union-attr]
            raise
        except Exception as error:  # noqa: BLE001 - safetensors' errors for a corrupt file are not ValueErrors
            for layer in self.layers.values():
                layer.lora.clear(slot - 1)  # type: ignore[union-attr]
            raise ValueError(f"{path}: cannot read the adapter ({error})") from None
        return touched

    def _load_module(self, index: int, module: str, a: torch.Tensor, b: torch.Tensor, config: AdapterConfig,
                     name: str) -> str:
        """One checkpoint module's ``a (r, in)`` and ``b (out, r)`` into slot ``index`` of its layer, this rank's
        share; returns the layer's name."""
        module = module.removeprefix(_PEFT_PREFIX)
        parent, _, leaf = module.rpartition(".")
        fused, shard = self._stacked.get(leaf, (leaf, None))
        layer_name = f"{parent}.{fused}"
        layer = self.layers.get(layer_name)
        if layer is None:
            routed = ".experts." in f"{module}." and ".shared_expert" not in module
            raise ValueError(f"adapter tensor {name}: the model has no LoRA-capable layer {module}"
                             + (" (LoRA on routed MoE experts is not supported)" if routed else ""))
        lora = layer.lora
        assert lora is not None
        r = config.r
        if a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"adapter tensor {name}: rank {a.shape[0]} / {b.shape[1]} differs from r={r}")
        a, b = a.to(lora.a.dtype), b.to(lora.b.dtype) * config.scaling  # (r, in), (out, r)
        try:
            if isinstance(layer, RowParallelLinear):
                if tuple(a.shape) != (r, layer.input_size) or tuple(b.shape) != (layer.output_size, r):
                    raise ValueError(f"shapes {list(a.shape)} / {list(b.shape)}, expected "
                                     f"{[r, layer.input_size]} / {[layer.output_size, r]}")
                size = layer.input_size_per_partition
                local_a = a[:, self.ctx.tp_rank * size:(self.ctx.tp_rank + 1) * size]  # A split by columns
                lora.set_part(index, 0, local_a, b)
                return layer_name
            if a.shape[1] != layer.input_size:
                raise ValueError(f"A has shape {list(a.shape)}, expected {[r, layer.input_size]}")
            local_b = torch.zeros(lora.b.shape[2], r, dtype=lora.b.dtype)  # (out_local, r): zeros outside the part
            name = name.replace(".lora_A.", ".lora_B.")  # B's shape is checked from here on
            layer.weight_loader(cast(nn.Parameter, local_b), b, shard)  # B split by rows, exactly like W
            part = _QKV_PARTS[shard] if isinstance(shard, str) else (shard or 0)
            lora.set_part(index, part, a, local_b)
        except ValueError as error:
            raise ValueError(f"adapter tensor {name}: {error}") from None
        return layer_name
