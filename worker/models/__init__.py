"""Model families, one file each; :func:`model_class` finds a checkpoint's class through the registry.

The table lives in tpserve/model_registry.py (torch-free, so the coordinator can
refuse an unknown architecture at start-up); the classes' contract with the
loader and the runner is worker/models/base.py's :class:`CausalLM`. The families
and what each needs are listed once, in README.md ("Serving a model").
"""

from __future__ import annotations

import importlib

from tpserve.model_registry import model_class_path
from worker.models.base import CausalLM


def model_class(architecture: str) -> type[CausalLM]:
    """The worker class serving ``architecture`` (e.g. ``"Qwen2ForCausalLM"``), imported on demand.

    Raises:
        ValueError: ``architecture`` is not in tpserve/model_registry.py.
    """
    module, name = model_class_path(architecture)
    return getattr(importlib.import_module(module), name)
