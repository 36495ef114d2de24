"""Weight-only int8 parameters of the parallel linear layers, and how they are filled.

An int8 layer holds ``weight`` ``(N_local, K_local)`` int8 and ``weight_scale``
float32 with ``w ~= weight * weight_scale[:, None]`` (per output channel, symmetric,
no zero point). The names are compressed-tensors' (tpserve/quantization.py), so an
int8 checkpoint's tensors map one to one onto the parameters.

Quantizing a float weight (absmax scaling per output channel, as in LLM.int8()'s
vector-wise quantization, Dettmers et al. 2022, arXiv:2208.07339, section 3.2, and
torchao's int8 weight-only scheme): in float32, from the checkpoint's own values,

    scale[n] = max_k |w[n, k]| / 127        q[n, k] = clamp(round(w[n, k] / scale[n]), -127, 127)

(a row of zeros gets scale 0 and q 0). Sharding, the same as the float weights:

* column-parallel (qkv, gate_up): a rank reads whole rows, so its rows' scales are
  computed from what it reads and split with the rows;
* row-parallel (o_proj, down_proj): a rank reads only its input columns but keeps
  the full ``(N,)`` scales of the WHOLE rows, read once at load time by
  :func:`row_scales` (a pass over the rows in chunks; load-time cost only). So
  quantizing then splitting equals splitting then quantizing, every rank's partial
  products carry the same scale, and the all-reduced sum equals tp 1's up to float
  summation order.

A checkpoint whose tensor is already int8 is copied as is; its scale then comes from
the checkpoint's ``weight_scale`` (``(N, 1)`` or ``(N,)``, any float dtype). A float
tensor in an int8 layer (``--quantization int8``, or a layer a compressed-tensors
checkpoint left in ``ignore``) is quantized here; the scale shards it computes are
recorded in ``weight_scale.computed_shard_ids`` so the loader does not ask the
checkpoint for them.

A stored scale is checked as it is read (a corrupt checkpoint must not start and
serve garbage): every scale must be finite, and a zero scale is allowed only for an
output row whose int8 weights are all zero (else that row would be served as zeros).
The second check needs both tensors, so it runs when the later of the pair (the
``weight`` or its ``weight_scale``, in whichever order the files hold them) is read;
the loader names the tensor in the ``ValueError``. Scales computed here from float
weights are not checked: a zero scale then means a zero row.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.weights import (CheckpointSource, check_finite_scales, check_shape, copy_into, new_parameter,
                                  read_narrow, source_shape)

INT8_MAX = 127
#: Elements read at once by :func:`row_scales` (64 MiB of float32).
_ROW_SCALES_CHUNK_ELEMENTS = 1 << 24


def quantize_rows(w: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization (formula in the module docstring).

    Args:
        w: ``(N, K)`` float weights, any float dtype (computed in float32).
        scales: ``(N,)`` float32 scales to use (a row-parallel shard's full-row scales);
            None: computed from ``w``'s rows.

    Returns:
        ``(q (N, K) int8, scales (N,) float32)``.

    Raises:
        ValueError: a row of ``w`` holds a NaN or an infinity (its scale would be non-finite).
    """
    w32 = w.float()  # (N, K)
    if scales is None:
        scales = check_finite_scales(w32.abs().amax(dim=1) / INT8_MAX)  # (N,)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # (N,); zero rows stay zero
    q = torch.round(w32 / divisor[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # (N, K)
    return q, scales.float()


def row_scales(source: CheckpointSource) -> torch.Tensor:
    """``(N,)`` float32 scales of the whole rows of the ``(N, K)`` float tensor behind ``source``.

    Reads the rows in chunks of at most ``_ROW_SCALES_CHUNK_ELEMENTS`` elements, so the
    full tensor is never held at once.
    """
    num_rows, num_cols = source_shape(source)
    step = max(1, _ROW_SCALES_CHUNK_ELEMENTS // max(1, num_cols))
    parts = [read_narrow(source, 0, start, min(step, num_rows - start)).float().abs().amax(dim=1)
             for start in range(0, num_rows, step)]
    return check_finite_scales(torch.cat(parts) / INT8_MAX)  # (N,)


def new_int8_weights(layer: nn.Module, shape: tuple[int, int], num_scales: int, device: torch.device) -> None:
    """Give ``layer`` an int8 ``weight`` of ``shape`` and a float32 ``weight_scale`` of ``(num_scales,)``.

    Both use ``layer.weight_loader``; ``weight_scale.shard_ids`` is set by the caller
    along with ``weight.shard_ids`` (the same ids: the checkpoint has one scale per weight).
    """
    layer.weight = new_parameter(shape, torch.int8, device, layer.weight_loader)
    layer.weight_scale = new_parameter((num_scales,), torch.float32, device, layer.weight_loader)
    layer.weight_scale.computed_shard_ids = set()  # type: ignore[attr-defined]
    # shard id -> which of "weight" / "scale" were read as stored, for _check_pair.
    layer.int8_stored_parts = {}


def load_rows(layer: nn.Module, param: nn.Parameter, source: CheckpointSource, total_rows: int,
              start: int, size: int, offset: int = 0, shard_id: object = None) -> None:
    """Column-parallel: rows ``[start, start + size)`` of ``source`` into rows ``[offset, offset + size)`` of ``param``.

    ``param`` is the layer's weight (float, or int8: a float source is quantized and its
    scales written too), its bias, or its ``weight_scale``.

    Raises:
        ValueError: the checkpoint tensor is not ``(total_rows, ...)``.
    """
    if param is getattr(layer, "weight_scale", None):
        _check_scale_shape(source, total_rows)
        scales = read_narrow(source, 0, start, size).reshape(size)
        _check_finite(scales, start)
        copy_into(param.data[offset:offset + size], scales)
        _check_pair(layer, "scale", shard_id, offset, size, start)
        return
    check_shape(source, (total_rows, *param.shape[1:]))
    rows = read_narrow(source, 0, start, size)  # (size, K)
    if param.dtype == torch.int8 and rows.dtype != torch.int8:
        rows, scales = quantize_rows(rows)
        copy_into(layer.weight_scale.data[offset:offset + size], scales)
        layer.weight_scale.computed_shard_ids.add(shard_id)
    copy_into(param.data[offset:offset + size], rows)
    if param.dtype == torch.int8 and shard_id not in layer.weight_scale.computed_shard_ids:
        _check_pair(layer, "weight", shard_id, offset, size, start)


def load_columns(layer: nn.Module, param: nn.Parameter, source: CheckpointSource, full_shape: tuple[int, int],
                 start: int, size: int) -> None:
    """Row-parallel: columns ``[start, start + size)`` of ``source`` into ``param`` (the weight), or the
    whole ``weight_scale``; a float source into an int8 weight is quantized with its whole rows' scales.

    Raises:
        ValueError: the checkpoint tensor is not ``full_shape`` (``(N,)`` / ``(N, 1)`` for the scale).
    """
    num_rows = full_shape[0]
    if param is getattr(layer, "weight_scale", None):
        _check_scale_shape(source, num_rows)
        scales = read_narrow(source, 0, 0, num_rows).reshape(num_rows)
        _check_finite(scales, 0)
        copy_into(param.data, scales)
        _check_pair(layer, "scale", None, 0, num_rows, 0)
        return
    check_shape(source, full_shape)
    columns = read_narrow(source, 1, start, size)  # (N, size)
    if param.dtype == torch.int8 and columns.dtype != torch.int8:
        scales = row_scales(source)  # (N,) over the whole rows, not just this rank's columns
        columns, _ = quantize_rows(columns, scales)
        copy_into(layer.weight_scale.data, scales)
        layer.weight_scale.computed_shard_ids.add(None)
    copy_into(param.data, columns)
    if param.dtype == torch.int8 and None not in layer.weight_scale.computed_shard_ids:
        _check_pair(layer, "weight", None, 0, num_rows, 0)


def _check_scale_shape(source: CheckpointSource, num_rows: int) -> None:
    shape = source_shape(source)
    if shape not in ((num_rows,), (num_rows, 1)):
        raise ValueError(f"weight_scale has shape {list(shape)}, expected [{num_rows}, 1] (one scale per output "
                         "channel: only per-channel int8 is supported)")


def _check_finite(scales: torch.Tensor, first_row: int) -> None:
    """Raise ``ValueError`` naming the first output row (checkpoint numbering) whose stored scale is NaN or inf."""
    bad = ~torch.isfinite(scales.float())  # (size,) bool
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"weight_scale of output row {first_row + row} is {float(scales[row])} "
                         f"({int(bad.sum())} non-finite scales): a corrupt checkpoint")


def _check_pair(layer: nn.Module, part: str, shard_id: object, offset: int, size: int, first_row: int) -> None:
    """Once a shard's stored int8 weight and stored scale are both read: refuse a zero scale of a non-zero row.

    Args:
        part: "weight" or "scale", the one just read.
        offset, size: the shard's rows in the layer's parameters.
        first_row: the shard's first row in the checkpoint tensor (for the message).

    Raises:
        ValueError: a row with scale 0 holds non-zero int8 weights (it would be served as zeros).
    """
    parts = layer.int8_stored_parts.setdefault(shard_id, set())
    parts.add(part)
    if parts != {"weight", "scale"}:
        return
    zero = layer.weight_scale.data[offset:offset + size] == 0  # (size,) bool
    if not bool(zero.any()):
        return
    nonzero_rows = layer.weight.data[offset:offset + size].ne(0).any(dim=1) & zero  # (size,) bool
    if bool(nonzero_rows.any()):
        row = int(nonzero_rows.nonzero()[0, 0])
        raise ValueError(f"weight_scale of output row {first_row + row} is 0 but the row's int8 weights are not "
                         f"all zero ({int(nonzero_rows.sum())} such rows): a corrupt checkpoint")
