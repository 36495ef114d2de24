"""The model embedded in the tpserve package (tpserve/default_model/README.md): served when
``--model`` is not given, and the tests' and benchmarks' small real checkpoint."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: Name GetModelInfo reports for the embedded model (its model card's name).
DEFAULT_MODEL_NAME = "tpserve-tiny-stories"


def default_model_dir() -> Path:
    """The embedded checkpoint's directory (config.json, model.safetensors, tokenizer.json)."""
    return Path(str(resources.files("tpserve") / "default_model"))
