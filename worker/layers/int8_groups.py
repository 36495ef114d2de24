"""Published 8-bit weight-only layers (GPTQ ``bits: 8``, compressed-tensors W8A16): their compute formats.

An 8-bit checkpoint arrives in the common form of worker/layers/int4_formats.py: codes ``q`` in
``[0, 255]``, a float32 scale ``s`` and zero point ``z`` per output row and group of ``G`` input
columns, ``w = s * (q - z)``. It is held in one of two forms, both exact (no requantization):

* **Per channel, symmetric** (``group_size: -1`` / ``strategy: channel``, ``sym: true``): ``z`` is
  128 (``2 ** (bits - 1)``, the formats' implied zero), so ``q - 128`` is an int8 in ``[-128, 127]``
  and ``w = s * (q - 128)`` is exactly the int8 layer's ``weight * weight_scale[:, None]``
  (worker/layers/int8_weights.py): the layer becomes an int8 layer (``weight (N, K)`` int8,
  ``weight_scale (N,)`` float32) and runs the int8 kernel (worker/layers/int8_matmul.py),
  the compiled decode layer included. A stored zero point other than 128 is refused, named.
* **Group-wise, or with zero points** (everything else): ``weight (N, K)`` uint8, the codes as
  stored, and ``weight_scale (N, K / G, 2)`` float32, ``(s, o)`` per row and group with
  ``w = s * q + o``, ``o = -s * z`` (the int4 layout's scale and offset, one code a byte): 8 bits a
  weight plus ``64 / G`` (8.5 at ``G = 128``). :func:`int8_groups_linear` is
  ``torch.ops.tpserve_cpu.linear_w8`` (worker/kernels/cpu_linear_w8.cpp: codes widened in registers,
  each group's scale applied once a group, the offsets as ``o * sum(x over the group)``).
  ``G`` must be a multiple of 32 (the loaders refuse other groups, naming the scales tensor).

Why a kernel of its own (measured on this project's 2-core AVX-512 host, one thread, best of 30,
groups of 128; the table in docs/design/models.md, "Published 8-bit weight-only checkpoints"): an
exact first form held each code as two 4-bit planes, ``q = 16 h + l``, on the int4 kernel
(``(2 N, K / 2)``, halves added). At 1 row it took 120 us for a 2304x768 layer and 852 us for
4096x4096, where this kernel takes 74 and 577 (the int8 kernel on the same bytes, per channel: 61
and 548; float32: 226 and 2123); at 4 rows 1302 against the planes' 1579 (4096x4096). From 5 rows on
the planes' AMX path and this kernel are about even. The compiled decode layer
(worker/layers/decode_block.py) takes the same op for a uint8 weight of ``K`` columns (an int4 weight
has ``K / 2``), bit-identical to the module path (tests/worker/test_decode_block.py). Without the compiled kernels, or on CUDA, the weights are
dequantized to ``x.dtype`` per call (a fallback, as for int4).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.kernels import cpu_kernels_available
from worker.layers.int4_formats import PARTS, Int4Tensor
from worker.layers.int4_matmul import BLOCK
from worker.layers.matmul import linear

#: The implied zero of symmetric 8-bit codes (the signed value plus 128).
INT8_MIDPOINT = 128


def int8_channel_layout(fmt: Any) -> bool:
    """Whether an 8-bit format is held as int8 per channel (symmetric, one group a row) rather than grouped."""
    return fmt.group_size == -1 and fmt.symmetric


def describe_8bit(fmt: Any) -> str:
    """The compute form of an 8-bit format, in words, for the start-up log line."""
    if int8_channel_layout(fmt):
        return "int8 per output channel (the int8 kernel)"
    return "8-bit codes with a scale and offset per group (the w8 kernel)"


def write_8bit(layer: Any, t: Int4Tensor, offset: int, shard_id: object, fmt: Any, stem: str) -> None:
    """This rank's rows of an 8-bit ``t`` (input columns in packed order) into the layer's rows ``[offset, ...)``.

    ``layer`` is an int4 layer (worker/layers/int4_weights.py: ``weight (N, K / 2)`` uint8 as
    allocated); its parameters are re-laid out on the first write (module docstring). ``stem`` is the
    checkpoint layer's name (``model.layers.1.self_attn.k_proj``), for the messages.

    Raises:
        ValueError: groups not a multiple of 32 columns or parts with different group counts (names
            the scales tensor), or a symmetric per-channel zero point other than 128 (names the zero
            points' tensor).
    """
    size, k = t.codes.shape
    tensor = {part: f"{stem}.{suffix}" for suffix, part in PARTS[fmt.method].items()}
    if int8_channel_layout(fmt):
        _write_int8(layer, t, offset, size, k, tensor["qzeros"])
    else:
        _write_groups(layer, t, offset, size, k, tensor["scales"])
    layer.weight_scale.computed_shard_ids.add(shard_id)


def _write_int8(layer: Any, t: Int4Tensor, offset: int, size: int, k: int, name: str) -> None:
    weight, scale = layer.weight, layer.weight_scale
    if weight.dtype != torch.int8:  # the first part: (N, K / 2) uint8 -> (N, K) int8 and (N,) scales
        weight.data = torch.empty((weight.shape[0], k), dtype=torch.int8, device=weight.device)
        scale.data = torch.empty((weight.shape[0],), dtype=torch.float32, device=scale.device)
    if not bool((t.zeros == INT8_MIDPOINT).all()):
        bad = t.zeros[t.zeros != INT8_MIDPOINT]
        raise ValueError(f"{name}: symmetric 8-bit zero points must be {INT8_MIDPOINT}, found {int(bad[0])}: "
                         "a corrupt checkpoint")
    weight.data[offset:offset + size].copy_((t.codes.to(torch.int16) - INT8_MIDPOINT).to(torch.int8))
    scale.data[offset:offset + size].copy_(t.scales[:, 0])


def _write_groups(layer: Any, t: Int4Tensor, offset: int, size: int, k: int, name: str) -> None:
    if t.group_size % BLOCK:
        raise ValueError(f"{name}: 8-bit groups of {t.group_size} columns are not a multiple of {BLOCK} "
                         "(the w8 kernel's)")
    weight, scale = layer.weight, layer.weight_scale
    groups = t.scales.shape[1]
    if not layer.int8_groups:  # the first part: a byte a code, room for the groups' scales and offsets
        layer.int8_groups = True
        weight.data = torch.empty((weight.shape[0], k), dtype=torch.uint8, device=weight.device)
        scale.data = torch.empty((weight.shape[0], groups, 2), dtype=torch.float32, device=scale.device)
    elif scale.shape[1] != groups:
        raise ValueError(f"{name}: 8-bit parts of one layer have different group sizes ({k // scale.shape[1]} "
                         f"and {t.group_size})")
    weight.data[offset:offset + size].copy_(t.codes)
    scale.data[offset:offset + size].copy_(torch.stack([t.scales, -t.scales * t.zeros], dim=2))  # (size, groups, 2)


def dequantize_groups(qweight: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    """``w = s * q + o`` as float32 ``(N, K)`` (the reference the kernel is tested against)."""
    n, k = qweight.shape
    groups = scale_offset.shape[1]
    q = qweight.float().reshape(n, groups, k // groups)
    return (q * scale_offset[:, :, :1] + scale_offset[:, :, 1:]).reshape(n, k)


def int8_groups_linear(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a grouped 8-bit layer, ``W = s * q + o`` group-wise (module docstring).

    Args:
        x: ``(T, K)`` activations in the model dtype.
        qweight: ``(N, K)`` uint8 codes.
        scale_offset: ``(N, K / G, 2)`` float32.
        bias: ``(N,)`` or None.

    Returns:
        ``(T, N)`` in ``x.dtype``. float32 activations on a CPU with the compiled kernels take
        ``torch.ops.tpserve_cpu.linear_w8`` (float32 accumulation; past 64 rows it dequantizes W once
        and multiplies with at::matmul); elsewhere W is dequantized to ``x.dtype`` and multiplied.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_kernels_available():
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        return torch.ops.tpserve_cpu.linear_w8(x.contiguous(), qweight, scale_offset, bias)  # (T, N)
    w = dequantize_groups(qweight, scale_offset).to(x.dtype)  # (N, K)
    return linear(x, w, bias)  # (T, N)
