"""FP8 weight-only linear layers (``--quantization fp8`` on an FP8 checkpoint): parameters, loading, matmul.

(``layer`` is typed ``Any`` here: the functions set and read attributes they add to an ``nn.Module``.)

An FP8 checkpoint's linear weights (tpserve/weight_formats.py: ``quant_method: fp8`` with block
``weight_scale_inv``, or compressed-tensors ``float-quantized`` per channel or tensor) are kept as
stored, 1 byte a weight, instead of being dequantized at load (worker/dequantize.py, the default):

* ``weight (N_local, K_local)`` ``torch.float8_e4m3fn``: the checkpoint's codes of this rank's rows
  (column-parallel) or columns (row-parallel);
* ``weight_scale (N_local, K_local / G)`` float32: ``w[n, k] = float(weight[n, k]) * weight_scale[n, k // G]``,
  the checkpoint's scales expanded over their block's rows; ``G`` per layer from the first part read
  (:meth:`~worker.dequantize.Fp8Source.read_codes`: the block width, smaller where a row-parallel
  shard starts inside a block; the whole row for per-channel and per-tensor scales).

So the weights are the checkpoint's exactly and the served model is the dequantized model: only the
summation order differs from the at-load path. :func:`fp8_linear` multiplies them: the compiled
kernel on a CPU (worker/kernels/cpu_linear_fp8.cpp: e4m3 converted in registers), elsewhere a
per-call dequantization to the activation dtype (the fallback: correct, not fast).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.dequantize import Fp8Source
from worker.kernels import cpu_kernels_available
from worker.layers.weights import CheckpointSource, check_shape, new_parameter


def new_fp8_weights(layer: Any, shape: tuple[int, int], device: torch.device) -> None:
    """Give ``layer`` an e4m3 ``weight`` of ``shape (N, K)`` and an empty ``weight_scale`` (sized by the first part)."""
    layer.weight = new_parameter(shape, torch.float8_e4m3fn, device, layer.weight_loader)
    layer.weight_scale = new_parameter((shape[0], 0), torch.float32, device, layer.weight_loader)
    layer.weight_scale.computed_shard_ids = set()  # the scales arrive with their weight, not by name
    layer.fp8 = True


def hold_unquantized_fp8(layer: Any) -> None:
    """Hold an fp8 layer (``--quantization fp8``) as a float one: the checkpoint stores this layer unquantized
    (its ``ignore`` / ``modules_to_not_convert``), so it is served as stored. ``weight`` becomes ``(N, K)`` in
    ``layer.float_dtype``, loaded by the float path; ``weight_scale`` is dropped (marked computed)."""
    layer.weight.data = torch.empty(layer.weight.shape, dtype=layer.float_dtype, device=layer.weight.device)
    scale = layer.weight_scale
    scale.computed_shard_ids = set(scale.shard_ids)
    layer.weight_scale = None
    layer.fp8 = False


def _fp8_source(source: CheckpointSource, what: str) -> Fp8Source:
    if not isinstance(source, Fp8Source):
        raise ValueError(f"--quantization fp8 keeps fp8 checkpoint weights, but this {what} is not stored in fp8 "
                         "(serve the checkpoint without --quantization fp8: it is then dequantized at load)")
    return source


def load_fp8_rows(layer: Any, source: CheckpointSource, total_rows: int, start: int, size: int, offset: int,
                  shard_id: object) -> None:
    """Column-parallel: rows ``[start, start + size)`` of an FP8 weight (or a fused part) into rows ``[offset, ...)``.

    Raises:
        ValueError: the source is not an FP8 tensor, its shape is not ``(total_rows, K)``, or its
            scale groups differ from the layer's other parts.
    """
    k = layer.weight.shape[1]
    fp8 = _fp8_source(source, "weight")
    check_shape(fp8, (total_rows, k))
    codes, scale = fp8.read_codes((start, start + size), (0, k))
    _write(layer, codes, scale, offset, shard_id)


def load_fp8_columns(layer: Any, source: CheckpointSource, full_shape: tuple[int, int], start: int, size: int) -> None:
    """Row-parallel: input columns ``[start, start + size)`` of an FP8 weight into the layer."""
    fp8 = _fp8_source(source, "weight")
    check_shape(fp8, full_shape)
    codes, scale = fp8.read_codes((0, full_shape[0]), (start, start + size))
    _write(layer, codes, scale, 0, None)


def _write(layer: Any, codes: torch.Tensor, scale: torch.Tensor, offset: int, shard_id: object) -> None:
    param = layer.weight_scale
    if param.shape[1] == 0:
        param.data = torch.empty((param.shape[0], scale.shape[1]), dtype=torch.float32, device=param.device)
    elif param.shape[1] != scale.shape[1]:
        raise ValueError(f"fp8 parts of one layer have different scale groups ({param.shape[1]} and "
                         f"{scale.shape[1]} per row)")
    layer.weight.data[offset:offset + codes.shape[0]].copy_(codes)
    param.data[offset:offset + codes.shape[0]].copy_(scale)
    param.computed_shard_ids.add(shard_id)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` float32 ``weight * scale`` per row and group (the reference the kernel is tested against)."""
    n, k = weight.shape
    groups = scale.shape[1]
    return (weight.float().reshape(n, groups, k // groups) * scale[:, :, None]).reshape(n, k)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only FP8 linear: ``x @ W.T + bias`` with ``W = weight * scale`` group-wise (module docstring).

    Args:
        x: ``(T, K)`` activations in the model dtype.
        weight: ``(N, K)`` ``torch.float8_e4m3fn``.
        scale: ``(N, K / G)`` float32.
        bias: ``(N,)`` or None.

    Returns:
        ``(T, N)`` in ``x.dtype``: float32 activations on a CPU with the compiled kernels take
        ``torch.ops.tpserve_cpu.linear_fp8`` (float32 accumulation); elsewhere W is dequantized to
        ``x.dtype`` for the call.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_kernels_available():
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        return torch.ops.tpserve_cpu.linear_fp8(x.contiguous(), weight, scale, bias)  # (T, N)
    w = dequantize_fp8(weight, scale).to(x.dtype)  # (N, K)
    return torch.nn.functional.linear(x, w, bias)  # (T, N)
