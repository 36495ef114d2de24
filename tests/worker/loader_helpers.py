"""Helpers that load and rewrite checkpoints, shared by the loader tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tpserve.model_config import ModelConfig
from worker.loader import checkpoint_files, load_model
from worker.parallel_state import ParallelContext


def _rewrite(source: Path, target: Path, edit) -> Path:
    """Copy ``source``'s config.json and a single-file checkpoint of its tensors after ``edit(dict)``."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = {}
    for path in set(checkpoint_files(source).values()):
        tensors.update(load_file(path))
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def _load(model_dir: Path):
    return load_model(model_dir, ModelConfig.from_pretrained(model_dir), ParallelContext.single(), torch.float32)
