"""Progress of a checkpoint load: one log line per safetensors file, with its bytes and time.

A large model comes in many shard files (``model-00001-of-00030.safetensors``, ...) and takes
minutes to read; without a line per file a start-up looks hung. Rank 0 logs at INFO, the other
ranks (which read the same files' slices) at DEBUG, so a group of eight ranks prints each file
once. A single-file checkpoint gets its one line too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog
import torch.distributed as dist

log = structlog.get_logger(__name__)


class ShardProgress:
    """Counts the checkpoint files as they are read.

    Args:
        files: every file the load will read, in reading order.
    """

    def __init__(self, files: Iterable[Path]) -> None:
        self.files = list(files)
        self.total_bytes = sum(path.stat().st_size for path in self.files)
        self.done_bytes = 0
        self.done = 0
        self.start = time.monotonic()
        first_rank = not dist.is_initialized() or dist.get_rank() == 0
        self._log = log.info if first_rank else log.debug

    @contextmanager
    def shard(self, path: Path) -> Iterator[None]:
        """Times the reading of ``path``; logs ``checkpoint file loaded`` with file i of n, its size
        in bytes and seconds, and the bytes and seconds so far (the file's size counts even though a
        tensor-parallel rank reads only its slices of it)."""
        began = time.monotonic()
        yield
        self.done += 1
        size = path.stat().st_size
        self.done_bytes += size
        self._log("checkpoint file loaded", file=path.name, shard=f"{self.done}/{len(self.files)}", bytes=size,
                  seconds=round(time.monotonic() - began, 2), loaded_bytes=self.done_bytes,
                  total_bytes=self.total_bytes, elapsed_seconds=round(time.monotonic() - self.start, 2))
