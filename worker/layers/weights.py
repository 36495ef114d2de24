"""Reading one rank's shard of a checkpoint tensor without reading the rest.

A *checkpoint source* is either a ``torch.Tensor`` (tests, tied weights) or a
``safetensors`` slice from ``safe_open(...).get_slice(name)``, which reads from
the file only the rows/columns it is indexed with. Both are indexed here with a
tuple of slices, so a rank never materialises the full tensor of a sharded
weight. Parallel layers attach ``weight_loader(param, source, shard_id)`` to each
parameter, built from these helpers.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class CheckpointSource(Protocol):
    """A ``torch.Tensor`` or a ``safetensors`` ``PySafeSlice``."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def source_shape(source: CheckpointSource) -> tuple[int, ...]:
    """Full shape of the checkpoint tensor behind ``source``."""
    if isinstance(source, torch.Tensor):
        return tuple(source.shape)
    return tuple(source.get_shape())  # type: ignore[attr-defined]


class RowRange:
    """Rows ``[first, first + num_rows)`` of a checkpoint source, itself a checkpoint source.

    A part of a fused checkpoint tensor (Phi-3's ``qkv_proj`` holds q, k and v's rows one
    after the other): indexing it reads only the rows asked for from the source behind.
    """

    def __init__(self, source: CheckpointSource, first: int, num_rows: int) -> None:
        self.source = source
        self.first = first
        self.num_rows = num_rows

    def get_shape(self) -> tuple[int, ...]:
        return (self.num_rows, *source_shape(self.source)[1:])

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"RowRange takes a tuple of unit-step slices, got {index!r}")
        start, stop, _ = rows.indices(self.num_rows)
        key = (slice(self.first + start, self.first + stop), *index[1:])  # (mypy's 3.10 parser: not inline)
        return self.source[key]


def load_fused(loader: Any, param: torch.nn.Parameter, source: CheckpointSource,
               parts: list[tuple[Any, int]]) -> None:
    """Load a fused checkpoint tensor part by part: ``loader(param, RowRange(...), shard_id)`` for each
    ``(shard_id, num_rows)`` of ``parts``, in the order their rows are stacked in ``source``.

    Raises:
        ValueError: ``source`` does not have ``sum(num_rows)`` rows.
    """
    total = sum(num_rows for _, num_rows in parts)
    shape = source_shape(source)
    if shape[0] != total:
        raise ValueError(f"fused checkpoint tensor has shape {list(shape)}, expected {total} rows "
                         f"({' + '.join(str(n) for _, n in parts)})")
    first = 0
    for shard_id, num_rows in parts:
        loader(param, RowRange(source, first, num_rows), shard_id)
        first += num_rows


def read_narrow(source: CheckpointSource, dim: int, start: int, size: int) -> torch.Tensor:
    """Read ``source[..., start:start + size, ...]`` along ``dim`` (0 or 1) only."""
    index = [slice(None)] * len(source_shape(source))
    index[dim] = slice(start, start + size)
    return source[tuple(index)]


def check_shape(source: CheckpointSource, expected: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless the checkpoint tensor has the ``expected`` full shape."""
    shape = source_shape(source)
    if shape != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {list(shape)}, expected {list(expected)}")


def copy_into(destination: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` into ``destination`` (same shape), casting to its dtype and device.

    Non-blocking: the loader reads slices onto the rank's GPU already (worker/loader.py),
    so this is a device-side cast and copy, ordered on the current stream.
    """
    if destination.shape != value.shape:
        raise ValueError(f"shard has shape {list(value.shape)}, expected {list(destination.shape)}")
    if value.dtype == torch.int8 and destination.dtype != torch.int8:
        # An int8 tensor cast to float would silently serve the quantized integers as weights.
        raise ValueError("an int8 tensor for a float parameter: is the checkpoint's quantization_config missing?")
    destination.copy_(value, non_blocking=True)


def load_replicated(param: torch.nn.Parameter, source: CheckpointSource, shard_id: Any = None) -> None:
    """``weight_loader`` of an unsplit parameter (norms, row-parallel bias): read it whole."""
    check_shape(source, tuple(param.shape))
    copy_into(param.data, source[tuple(slice(None) for _ in param.shape)])


def new_parameter(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, loader: Any = load_replicated
) -> torch.nn.Parameter:
    """An uninitialised parameter (filled by the loader, never randomly) with its ``weight_loader``."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def check_finite_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` computed at load from float weights (any shape), once every one is finite.

    A NaN or an infinity in the checkpoint's weights makes its row's (or group's) absmax scale non-finite, and
    the quantized layer would then give NaN logits for every request: refused at start-up instead (the loader
    adds the weight's name).

    Raises:
        ValueError: how many scales (rows or groups of weights) are non-finite.
    """
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        raise ValueError(f"{int(bad.sum())} of its {scales.numel()} quantization rows or groups hold NaN or infinite "
                         "weights: a corrupt checkpoint")
    return scales
