"""Fixtures of the worker tests: tiny random checkpoints and the stories260k model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's GPU kernels (worker/kernels/triton_attention.py) then run on CPU tensors in its
    # interpreter; Triton reads this when it is first imported, so it is set before any test runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.paths import GOLDENS_PATH, STORIES_DIR, load_goldens
from tests.tiny_models import TINY_MODELS, save_tiny_model


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every variant of tests/tiny_models.py saved once per session: name -> directory."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {spec.name: save_tiny_model(spec, root / spec.name) for spec in TINY_MODELS}


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real trained stories260k checkpoint (read-only, shared)."""
    if not (STORIES_DIR / "config.json").is_file():
        pytest.skip(f"the shared stories260k model is not at {STORIES_DIR} (set TPSERVE_SHARED_DIR)")
    return STORIES_DIR


@pytest.fixture(scope="session")
def golden_lines() -> list[dict]:
    """The stories260k greedy goldens (prompt ids and completion ids per line)."""
    if not GOLDENS_PATH.is_file():
        pytest.skip(f"the shared goldens are not at {GOLDENS_PATH} (set TPSERVE_SHARED_DIR)")
    return load_goldens()
