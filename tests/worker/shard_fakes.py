"""Stand-ins for a rank's parallel context and checkpoint source, shared by the layer tests (tp shards on one process)."""

from __future__ import annotations

import torch

from worker.parallel_state import ParallelContext


class ShardOnlyContext(ParallelContext):
    """Rank ``tp_rank`` of a ``tp_size`` tensor-parallel group with identity collectives: layers return partials."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_to_rank0(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


class RecordingSource:
    """A checkpoint source like a safetensors slice (``get_shape``, indexing) that logs reads."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.reads: list[tuple[slice, ...]] = []

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        self.reads.append(index)
        return self.tensor[index]
