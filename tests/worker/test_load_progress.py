"""Loading a sharded checkpoint logs one line per file: which of how many, its bytes, the time."""

from __future__ import annotations

from pathlib import Path

import torch
from structlog.testing import capture_logs

from tpserve.model_config import ModelConfig
from worker.loader import checkpoint_files, load_model
from worker.parallel_state import ParallelContext


def test_each_checkpoint_file_is_logged_with_bytes_and_time(tiny_checkpoints: dict[str, Path]) -> None:
    model_dir = tiny_checkpoints["sharded_linear_rope"]
    files = sorted(set(checkpoint_files(model_dir).values()))
    assert len(files) > 1
    with capture_logs() as logs:
        load_model(model_dir, ModelConfig.from_pretrained(model_dir), ParallelContext.single(), torch.float32)
    lines = [entry for entry in logs if entry["event"] == "checkpoint file loaded"]
    assert all(entry["log_level"] == "info" for entry in lines)  # rank 0 (no process group: one process)
    assert sorted(entry["file"] for entry in lines) == [path.name for path in files]
    assert [entry["shard"] for entry in lines] == [f"{i}/{len(files)}" for i in range(1, len(files) + 1)]
    sizes = {path.name: path.stat().st_size for path in files}
    assert all(entry["bytes"] == sizes[entry["file"]] and entry["seconds"] >= 0 for entry in lines)
    running = 0
    for entry in lines:
        running += entry["bytes"]
        assert entry["loaded_bytes"] == running and entry["total_bytes"] == sum(sizes.values())
    assert lines[-1]["elapsed_seconds"] >= max(entry["seconds"] for entry in lines)
