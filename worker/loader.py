"""Load one rank's shard of a Hugging Face safetensors checkpoint into the model.

Checkpoint layouts: a single ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: file name}}``).

Each tensor is opened lazily with ``safe_open(file, framework="pt", device=...).get_slice(name)``
and handed to its parameter's ``weight_loader``, which reads only this rank's
rows or columns (see worker/layers/weights.py): no rank ever holds the full
tensor of a sharded weight. On CUDA the files are opened with the rank's GPU as
the device, so safetensors copies each slice from the memory-mapped file straight
to that GPU, and the cast into the parameter is a non-blocking copy on the GPU;
no CPU tensor of a weight is ever cast or kept. The model is built with
uninitialised parameters (no random initialisation), then filled here.

Checkpoint names map to parameters one to one, except the fused projections:
``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj`` (shard ``"q"``/``"k"``/``"v"``) and
``gate_proj``/``up_proj`` -> ``gate_up_proj`` (shard 0/1). ``lm_head.weight``
absent means tied word embeddings; ``rotary_emb.inv_freq`` buffers are skipped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from tpserve.model_config import ModelConfig
from worker.model import LlamaForCausalLM
from worker.parallel_state import ParallelContext

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
_FUSED: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNFUSED = {value: key for key, value in _FUSED.items()}


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file holding it.

    Raises:
        FileNotFoundError: neither ``model.safetensors`` nor its index exists.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_model(
    model_dir: str | Path, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype
) -> LlamaForCausalLM:
    """Build this rank's shard of the model and fill it from ``model_dir``.

    Args:
        model_dir: directory with ``config.json`` and the safetensors files.
        config: the parsed ``config.json``.
        ctx: this rank's tensor-parallel group (rank and degree pick the slices).
        dtype: dtype the weights are cast to.

    Raises:
        ValueError: the checkpoint lacks weights the model needs, holds weights it
            does not know, or a tensor has the wrong shape (each error names them).
    """
    files = checkpoint_files(model_dir)
    tied = config.tie_word_embeddings or LM_HEAD not in files
    # Parameters are allocated uninitialised (torch.empty) on ctx.device: nothing
    # is randomly initialised, and each is written once, by its weight_loader.
    model = LlamaForCausalLM(config, ctx, dtype, tie_word_embeddings=tied)
    load_weights(model, files, ctx.device)
    return model.eval()


def read_device(device: torch.device) -> str:
    """Where safetensors puts the slices it reads: the rank's GPU, else the CPU (also for meta)."""
    return str(device) if device.type == "cuda" else "cpu"


def load_weights(model: torch.nn.Module, files: dict[str, Path], device: torch.device | None = None) -> None:
    """Fill every parameter of ``model`` from the checkpoint tensors in ``files``.

    Args:
        model: parameters carrying ``weight_loader`` and ``shard_ids``.
        files: tensor name -> file.
        device: the parameters' device; CUDA slices are read straight onto it.

    Raises:
        ValueError: unexpected, missing or mis-shaped weights, named.
    """
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    targets: dict[str, tuple[str, str | int | None]] = {}
    unexpected = []
    for name in files:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == LM_HEAD):
            continue  # recomputed / shared with the embedding
        param_name, shard_id = _parameter_for(name)
        param = params.get(param_name)
        if param is None or shard_id not in param.shard_ids:  # type: ignore[attr-defined]
            unexpected.append(name)
        targets[name] = (param_name, shard_id)
    if unexpected:
        raise ValueError(f"checkpoint has weights the model does not use: {sorted(unexpected)}")

    loaded: set[tuple[str, str | int | None]] = set()
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device=read_device(device or torch.device("cpu"))) as f:
            for name in names:
                param_name, shard_id = targets[name]
                param = params[param_name]
                try:
                    param.weight_loader(param, f.get_slice(name), shard_id)  # type: ignore[attr-defined]
                except ValueError as error:
                    raise ValueError(f"weight {name!r}: {error}") from error
                loaded.add((param_name, shard_id))

    expected = {(name, shard) for name, p in params.items() for shard in p.shard_ids}  # type: ignore[attr-defined]
    missing = sorted(_checkpoint_name(name, shard) for name, shard in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing}")


def _parameter_for(checkpoint_name: str) -> tuple[str, str | int | None]:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``model.layers.0.self_attn.qkv_proj.weight``, ``"k"``)."""
    parts = checkpoint_name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            parts[i], shard_id = _FUSED[part]
            return ".".join(parts), shard_id
    return checkpoint_name, None


def _checkpoint_name(param_name: str, shard_id: str | int | None) -> str:
    """Inverse of :func:`_parameter_for`, for error messages."""
    if shard_id is None:
        return param_name
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if (part, shard_id) in _UNFUSED:
            parts[i] = _UNFUSED[(part, shard_id)]
    return ".".join(parts)
