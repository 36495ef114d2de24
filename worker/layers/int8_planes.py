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
* **Group-wise, or with zero points** (everything else): each code is split into its two nibbles,
  ``q = 16 h + l`` with ``h, l`` in ``[0, 15]``, so

      w = s * (q - z) = (16 s) * h + (-s * z)  +  s * l + 0

  i.e. the sum of two 4-bit weights in the int4 kernel's layout (worker/layers/int4_matmul.py:
  ``w = scale * code + offset`` per group): the high plane with ``(16 s, -s z)``, the low plane with
  ``(s, 0)``. The layer holds both planes stacked, ``weight (2 N, K / 2)`` uint8 and
  ``weight_scale (2 N, K / G, 2)`` (rows ``[0, N)`` high, ``[N, 2 N)`` low), and
  :func:`int8_planes_linear` runs the int4 kernel once over the ``2 N`` rows and adds the halves:
  ``y = x @ W_h.T + x @ W_l.T``. ``16 s`` is exact in float32 (a power of two), so the planes
  denote exactly the checkpoint's weights; the products are summed in float32 as for any layer.

Why nibble planes and not a kernel of its own: the int4 kernel already reads packed codes and
applies each group's scale and offset in registers on every path (AVX2, AVX-512, VNNI, AMX), so the
planes read 8 bits a weight (2 x 4) plus ``2 x 64 / G`` bits of scales and offsets (9 bits at
``G = 128``, against int8's 8.25 and a float32 dequantization's 32), with no new compiled code and
no rounding. Its cost over a dedicated 8-bit kernel: twice the kernel's per-code work and the
scale/offset reads, the ``(T, 2 N)`` output and one add. Measured (2-core AVX-512 host, one thread, best
of 30, groups of 128): a 2304x768 layer at 1 row 116 us against the int8 kernel's 61 on the same bytes
per channel and float32's 220; 4096x4096 at 1 row 817 us against 505 and 2092 (docs/design/models.md,
"Published 8-bit weight-only checkpoints"): about 0.6x int8 per channel, 1.9-2.6x float32. A dedicated
group-scaled 8-bit kernel would close most of the gap to int8; it is the next step if group-wise 8-bit
checkpoints matter. The compiled decode layer (worker/layers/decode_block.py) has no plane sum, so a
model with plane layers takes the module path for decode (worker/loader.py switches it off).
CUDA takes the int4 fallback (dequantize per call), as 4-bit checkpoints do.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.kernels import cpu_kernels_available
from worker.layers.int4_formats import PARTS, Int4Tensor
from worker.layers.int4_matmul import BLOCK, dequantize, int4_linear, pack_codes
from worker.layers.matmul import linear

#: The implied zero of symmetric 8-bit codes (the signed value plus 128).
INT8_MIDPOINT = 128
#: Rows of x above which the planes are dequantized once into one float32 ``(N, K)`` matrix and multiplied
#: by it (the int4 kernel dequantizes its ``(2 N, K)`` past 64 rows anyway: one ``(N, K)`` product is half
#: that work; measured, module docstring).
DEQUANTIZE_ROWS = 64


def int8_channel_layout(fmt: Any) -> bool:
    """Whether an 8-bit format is held as int8 per channel (symmetric, one group a row) rather than as planes."""
    return fmt.group_size == -1 and fmt.symmetric


def describe_8bit(fmt: Any) -> str:
    """The compute form of an 8-bit format, in words, for the start-up log line."""
    if int8_channel_layout(fmt):
        return "int8 per output channel (the int8 kernel)"
    return "two 4-bit planes per weight (the int4 kernel; the compiled decode layer off)"


def split_planes(t: Int4Tensor) -> tuple[Int4Tensor, Int4Tensor]:
    """8-bit codes -> ``(high, low)`` 4-bit tensors whose dequantizations sum to ``t``'s (module docstring).

    Both keep ``t``'s groups and ``g_idx``; ``Int4Tensor``'s ``w = s * (q - z)`` form holds them as
    ``high = (16 s) * (h - z / 16)`` and ``low = s * (l - 0)``.
    """
    high = Int4Tensor(t.codes >> 4, t.scales * 16.0, t.zeros / 16.0, t.g_idx)
    low = Int4Tensor(t.codes & 0x0F, t.scales, torch.zeros_like(t.zeros), t.g_idx)
    return high, low


def write_8bit(layer: Any, t: Int4Tensor, offset: int, shard_id: object, fmt: Any, stem: str) -> None:
    """This rank's rows of an 8-bit ``t`` (input columns in packed order) into the layer's rows ``[offset, ...)``.

    ``layer`` is an int4 layer (worker/layers/int4_weights.py: ``weight (N, K / 2)`` uint8 as
    allocated); its parameters are re-laid out on the first write (module docstring). ``stem`` is the
    checkpoint layer's name (``model.layers.1.self_attn.k_proj``), for the messages.

    Raises:
        ValueError: a plane layer's groups not a multiple of 32 columns, parts with different group
            counts (names the scales tensor), or a symmetric per-channel zero point other than 128
            (names the zero points' tensor).
    """
    size, k = t.codes.shape
    tensor = {part: f"{stem}.{suffix}" for suffix, part in PARTS[fmt.method].items()}
    if int8_channel_layout(fmt):
        _write_int8(layer, t, offset, size, k, tensor["qzeros"])
    else:
        _write_planes(layer, t, offset, size, k, tensor["scales"])
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


def _write_planes(layer: Any, t: Int4Tensor, offset: int, size: int, k: int, name: str) -> None:
    if t.group_size % BLOCK:
        raise ValueError(f"{name}: 8-bit groups of {t.group_size} columns are not a multiple of {BLOCK} "
                         "(the int4 kernel's block)")
    weight, scale = layer.weight, layer.weight_scale
    groups = t.scales.shape[1]
    if not layer.int8_planes:  # the first part: room for both planes
        layer.int8_planes = True
        weight.data = torch.empty((2 * weight.shape[0], k // 2), dtype=torch.uint8, device=weight.device)
        scale.data = torch.empty((weight.shape[0], groups, 2), dtype=torch.float32, device=scale.device)
    elif scale.shape[1] != groups:
        raise ValueError(f"{name}: 8-bit parts of one layer have different group sizes ({k // scale.shape[1]} "
                         f"and {t.group_size})")
    rows = weight.shape[0] // 2
    for base, plane in zip((0, rows), split_planes(t), strict=True):
        scale_offset = torch.stack([plane.scales, -plane.scales * plane.zeros], dim=2)  # (size, groups, 2)
        weight.data[base + offset:base + offset + size].copy_(pack_codes(plane.codes))
        scale.data[base + offset:base + offset + size].copy_(scale_offset)


def int8_planes_linear(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for an 8-bit layer held as two 4-bit planes (module docstring).

    Args:
        x: ``(T, K)`` activations in the model dtype.
        qweight: ``(2 N, K / 2)`` uint8, the high plane's rows then the low plane's.
        scale_offset: ``(2 N, K / G, 2)`` float32.
        bias: ``(N,)`` or None.

    Returns:
        ``(T, N)`` in ``x.dtype``. Up to :data:`DEQUANTIZE_ROWS` rows: the int4 kernel over both planes
        (codes widened in registers), halves added; more (a prefill): ``W = W_h + W_l`` as float32 once,
        then one float product.
    """
    n = qweight.shape[0] // 2
    if x.shape[0] > DEQUANTIZE_ROWS:
        if x.device.type == "cpu" and cpu_kernels_available():
            w = torch.ops.tpserve_cpu.dequantize_int4(qweight, scale_offset)  # (2 N, K) float32
        else:
            w = dequantize(qweight, scale_offset)  # (2 N, K) float32
        return linear(x, (w[:n] + w[n:]).to(x.dtype), bias)  # (T, N)
    y = int4_linear(x, qweight, scale_offset)  # (T, 2 N)
    out = y[:, :n] + y[:, n:]  # (T, N)
    if bias is not None:
        out += bias
    return out
