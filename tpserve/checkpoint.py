"""Which tensors a safetensors checkpoint holds, read without torch, and what the model config needs of them.

The leader checks a checkpoint against its config before any rank starts (launch/startup.py),
and each rank's loader (worker/loader.py) lists the same files to read its slices: both
use :func:`checkpoint_files`. A ``.safetensors`` file starts with an 8-byte little-endian
header length and a JSON header naming every tensor, so listing reads a few kilobytes,
never a weight.

Layouts: a single ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``{"weight_map": {tensor name: file name}}``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection
from pathlib import Path

from tpserve.model_config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
#: A header longer than this is not a safetensors header (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file holding it.

    Raises:
        FileNotFoundError: neither ``model.safetensors`` nor its index exists.
        ValueError: the index or the file's header is not what the format says.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    return {name: single for name in _tensor_names(single)}


def check_head_weights(config: ModelConfig, tensor_names: Collection[str]) -> None:
    """Refuse an untied model whose checkpoint has no LM head.

    With ``tie_word_embeddings`` false the head is a weight of its own: serving the embedding in
    its place (what a missing ``lm_head.weight`` once meant) answers with another model's logits.
    A GPTQ checkpoint with ``lm_head: true`` stores it packed (``lm_head.qweight`` ...).

    Raises:
        ValueError: ``config.json tie_word_embeddings=false but the checkpoint has no lm_head.weight ...``.
    """
    packed_head = f"{LM_HEAD.removesuffix('.weight')}.qweight"  # GPTQ lm_head: true (dequantized at load)
    if not config.tie_word_embeddings and LM_HEAD not in tensor_names and packed_head not in tensor_names:
        raise ValueError(f"config.json tie_word_embeddings=false but the checkpoint has no {LM_HEAD} "
                         "(an untied model needs its LM head; set tie_word_embeddings to true only if the head "
                         "is the embedding)")


def tensor_dtypes(files: dict[str, Path]) -> dict[str, str]:
    """Each tensor's stored dtype as its file's header names it (``"BF16"``, ``"F16"``, ``"F32"``, ``"F8_E4M3"``,
    ...), for the names in ``files`` (name -> file, :func:`checkpoint_files`); each file's header read once, no data.

    Raises:
        ValueError: a file's header is not what the format says.
    """
    dtypes: dict[str, str] = {}
    for path in sorted(set(files.values())):
        dtypes.update((name, entry["dtype"]) for name, entry in _header(path).items() if name != "__metadata__")
    return {name: dtypes[name] for name in files if name in dtypes}


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in one ``.safetensors`` file's header (its ``__metadata__`` left out)."""
    return [name for name in _header(path) if name != "__metadata__"]


def _header(path: Path) -> dict:
    """One ``.safetensors`` file's header: tensor name -> ``{"dtype", "shape", "data_offsets"}``, and ``__metadata__``."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
        (size,) = struct.unpack("<Q", prefix)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file (header length {size})")
        return json.loads(f.read(size))
