"""Published 8-bit checkpoints' routed experts (GPTQ ``bits: 8``, compressed-tensors W8A16 per-expert modules).

An 8-bit checkpoint's experts arrive as a 4-bit one's do (worker/layers/moe_int4.py: one module per expert,
its packed tensors handed over as :class:`~worker.layers.int4_weights.PackedPart` s and unpacked to the common
form ``w = s * (q - z)``, codes in ``[0, 255]``, by the format's reference dequantization,
worker/layers/int4_formats.py). They are held exactly, in the two forms of a dense 8-bit layer
(worker/layers/int8_groups.py), chosen by the format when the layer's first expert part arrives (the
:class:`~worker.layers.moe.FusedMoE` was built for packed 4-bit codes; its stacks are re-laid out then):

* **per channel, symmetric** (``group_size: -1`` / ``strategy: channel``, ``sym``): the zero point is 128,
  so ``q - 128`` is an int8 and the experts become ``--quantization int8`` experts exactly
  (worker/layers/moe_int8.py's layout: ``gate_up_proj (E, 2 * I, H)`` int8 with ``(E, 2 * I)`` float32
  scales, ``down_proj (E, H, I)`` with ``(E, H)``), run by ``linear_int8``. A checkpoint scale is its whole
  row's, so a tensor-parallel rank's down columns keep it and the ranks' partials sum to tp 1's (row-parallel);
* **group-wise, or with zero points**: a byte a code, ``gate_up_proj (E, 2 * I, H)`` uint8 with
  ``(E, 2 * I, H / G1, 2)`` float32 ``(s, o)`` pairs, ``o = -s * z``; ``down_proj (E, H, I)`` uint8 with
  ``(E, H, I / G2, 2)``; run by ``linear_w8`` per expert (worker/layers/moe_experts.py tells it from a 4-bit
  stack by the codes' width: ``K`` columns, not ``K / 2``). ``G`` must be a multiple of 32 (the kernel's).

Act-order experts (``desc_act``) keep a column permutation per expert as 4-bit ones do
(:func:`~worker.layers.moe_int4.rank_part`), and a tensor-parallel rank's down columns must hold whole
groups (:func:`~worker.layers.int4_weights.column_slice`; expert parallelism holds whole experts). Bytes per
expert weight: 1 + 4 / K (per channel) or 1 + 8 / G (grouped), against 4 for float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.layers.int4_formats import PARTS, Int4Tensor
from worker.layers.int4_weights import PackedPart, unpacked_part
from worker.layers.int8_groups import INT8_MIDPOINT, int8_channel_layout
from worker.layers.moe_int4 import rank_part, ready_group_scales


def load_8bit_expert(moe: Any, param: nn.Parameter, source: PackedPart, shard_id: tuple[int, str], slot: int,
                     start: int, local: int) -> None:
    """One 8-bit expert part ``shard_id = (e, kind)`` into slot ``slot`` of ``param`` once its tensors are all read.

    Args:
        moe: the :class:`~worker.layers.moe.FusedMoE` (built with 4-bit stacks: re-laid out at the first part).
        param: ``moe.gate_up_proj`` or ``moe.down_proj``.
        source: one packed tensor of the expert part (qweight, scales, zero points, g_idx).
        slot: the expert's index in this rank's stack.
        start, local: this rank's range of the intermediate dimension.

    Raises:
        ValueError: a corrupt part (named by the unpacker), groups not a multiple of 32 columns, a symmetric
            per-channel zero point other than 128, experts of one layer in different layouts or group sizes,
            or act-order groups spread over the tensor-parallel ranks' down columns (each names the tensor).
    """
    kind = shard_id[1]
    full_shape = (moe.hidden_size, moe.intermediate_size) if kind == "down" else (moe.intermediate_size,
                                                                                  moe.hidden_size)
    full = unpacked_part(moe, source, full_shape, shard_id)
    if full is None:
        return  # the expert part's other tensors are still unread
    names = {part: f"{source.name.rpartition('.')[0]}.{suffix}" for suffix, part in PARTS[source.fmt.method].items()}
    channel = int8_channel_layout(source.fmt)
    _relayout(moe, channel, names["qweight"])
    t = rank_part(moe, full, kind, slot, start, local, source.name)
    scale = moe.down_proj_scale if kind == "down" else moe.gate_up_proj_scale
    rows = slice(local if kind == "up" else 0, (local if kind == "up" else 0) + t.codes.shape[0])
    if channel:
        if not bool((t.zeros == INT8_MIDPOINT).all()):
            bad = t.zeros[t.zeros != INT8_MIDPOINT]
            raise ValueError(f"{names['qzeros']}: symmetric 8-bit zero points must be {INT8_MIDPOINT}, found "
                             f"{int(bad[0])}: a corrupt checkpoint")
        param.data[slot, rows].copy_((t.codes.to(torch.int16) - INT8_MIDPOINT).to(torch.int8))
        scale.data[slot, rows].copy_(t.scales[:, 0])
    else:
        _write_groups(param, scale, t, slot, rows, names["scales"])
    scale.computed_shard_ids.add(shard_id)


def _relayout(moe: Any, channel: bool, name: str) -> None:
    """The layer's stacks in the 8-bit form ``channel`` picks (module docstring), at its first 8-bit part.

    Raises:
        ValueError: a part in the other form than the layer's earlier ones (names ``name``).
    """
    layout = "channel" if channel else "groups"
    if getattr(moe, "w8_layout", None) == layout:
        return
    if getattr(moe, "w8_layout", None) is not None:
        raise ValueError(f"{name}: 8-bit experts of one layer mix per-channel and group-wise layouts: not served")
    moe.w8_layout = layout
    moe.int4_stacks = ()  # no tile layout: it is the 4-bit kernel's
    dtype = torch.int8 if channel else torch.uint8
    for weight, scale in ((moe.gate_up_proj, moe.gate_up_proj_scale), (moe.down_proj, moe.down_proj_scale)):
        held, rows, half = weight.shape
        weight.data = torch.zeros((held, rows, 2 * half), dtype=dtype, device=weight.device)  # (E, N, K)
        shape = (held, rows) if channel else (held, rows, 0, 2)  # groups allocated at the first write
        scale.data = torch.zeros(shape, dtype=torch.float32, device=scale.device)


def _write_groups(param: nn.Parameter, scale: nn.Parameter, t: Int4Tensor, slot: int, rows: slice,
                  name: str) -> None:
    """Codes as stored and ``(s, -s * z)`` per row and group into expert ``slot``'s ``rows``."""
    ready_group_scales(scale, t, f"{name}: 8-bit")
    param.data[slot, rows].copy_(t.codes)
    scale.data[slot, rows].copy_(torch.stack([t.scales, -t.scales * t.zeros], dim=2))  # (rows, groups, 2)


def dequantize_w8_experts(q: torch.Tensor, scale_offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q (E, N, K) uint8``, ``scale_offset (E, N, K / G, 2)`` float32 -> ``s * q + o`` ``(E, N, K)`` in ``dtype``
    (computed in float32, rounded once)."""
    experts, rows, k = q.shape
    groups = scale_offset.shape[2]
    w = q.float().reshape(experts, rows, groups, k // groups)
    return (w * scale_offset[..., :1] + scale_offset[..., 1:]).reshape(experts, rows, k).to(dtype)
