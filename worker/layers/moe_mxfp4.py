"""gpt-oss's MXFP4 experts held exactly as 8-bit codes on the CPU: 10 bits a weight instead of float32's 32.

An MXFP4 value (worker/dequantize.py) is an e2m1 number ``v``, a multiple of 0.5 up to 6, times ``2 ** (e - 127)``
for its group of 32's e8m0 byte ``e``. So ``2 v`` is an integer in [-12, 12] and

    w = v * 2 ** (e - 127) = s * (2 v + 12) + o,   s = 2 ** (e - 128),  o = -12 s

is an 8-bit code ``q = 2 v + 12`` in [0, 24] with a float32 (scale, offset) pair per group of 32 input columns:
the grouped 8-bit layout of an 8-bit checkpoint's experts (worker/layers/moe_w8.py, ``linear_w8`` per expert), exactly
(a power-of-two scale times a small integer is exact in float32 down to ``e = 1``; ``e = 0`` gives a
float32 subnormal scale, still exact). The kernel sums ``s * sum(q x) + o * sum(x)`` per group: with the zero at
12 rather than at 128 the two terms cancel little (at 128, ``q x`` carried 128 x and the difference lost about
3 bits: a logit of the tiny gpt-oss moved 1.1e-4 from transformers', against 1e-4 for every other format).
Stacks (this rank's ``I`` units, gate/up de-interleaved as the float
path does, worker/layers/moe_stacked.py)::

    gate_up_proj (E, 2 * I, H) uint8   gate_up_proj_scale (E, 2 * I, H / 32, 2) float32   [gate | up] rows
    down_proj    (E, H, I)     uint8   down_proj_scale    (E, H, I / 32, 2)     float32

Where: CPU ranks with the compiled kernels, when ``H`` and this rank's ``I`` are multiples of 32 (groups never
cross a rank's columns); elsewhere (CUDA, whose grouped Triton kernel takes float weights; other shapes) the
experts are dequantized at load as before. A decode step reads 8 bits a weight plus 2 bits of scales where it read
32: measured in benchmarks/mxfp4_experts.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpserve.weight_formats import MXFP4_GROUP
from worker.dequantize import Mxfp4Source
from worker.kernels import cpu_kernels_available


def mxfp4_codes_apply(moe: Any, source: object) -> bool:
    """Whether ``moe`` (a :class:`~worker.layers.moe_stacked.StackedFusedMoE`) holds ``source``'s experts as codes."""
    if getattr(moe, "mxfp4_w8", None) is not None:
        return moe.mxfp4_w8
    if not isinstance(source, Mxfp4Source):
        return False
    local = moe.intermediate_size_per_partition
    why_not = ("not a CPU rank" if moe.ctx.device.type != "cpu" else
               "no compiled CPU kernels" if not cpu_kernels_available() else
               f"--dtype {str(moe.gate_up_proj.dtype).removeprefix('torch.')} (the w8 kernel takes float32)"
               if moe.gate_up_proj.dtype != torch.float32 else
               f"hidden_size {moe.hidden_size} or this rank's {local} expert units not a multiple of {MXFP4_GROUP}"
               if moe.hidden_size % MXFP4_GROUP or local % MXFP4_GROUP else None)
    moe.mxfp4_w8 = why_not is None
    # the loader's log line says why a CPU rank dequantized the experts instead (CUDA always does: no reason given)
    moe.mxfp4_w8_why_not = why_not if moe.ctx.device.type == "cpu" else None
    if moe.mxfp4_w8:
        _relayout(moe)
    return moe.mxfp4_w8


def _relayout(moe: Any) -> None:
    """uint8 stacks and float32 scale/offset parameters (shapes in the module docstring), filled by :func:`load`."""
    for weight_name in ("gate_up_proj", "down_proj"):
        weight = getattr(moe, weight_name)
        held, rows, k = weight.shape
        weight.data = torch.zeros((held, rows, k), dtype=torch.uint8, device=weight.device)
        scale = torch.zeros((held, rows, k // MXFP4_GROUP, 2), dtype=torch.float32, device=weight.device)
        setattr(moe, f"{weight_name}_scale", nn.Parameter(scale, requires_grad=False))


def load(moe: Any, param: nn.Parameter, source: Mxfp4Source) -> None:
    """Fill ``gate_up_proj`` (this rank's units, de-interleaved) or ``down_proj`` (its input columns) as codes.

    ``source`` is the virtual ``(E, A, B)`` tensor: gate_up ``(E, H, 2 * I)`` with column ``2j`` gate unit ``j``
    and ``2j + 1`` up unit ``j``; down ``(E, I, H)``.
    """
    local = moe.intermediate_size_per_partition
    start = moe.ctx.tp_rank * local
    for e in range(moe.num_experts):  # one expert at a time, as the float path reads
        if param is moe.gate_up_proj:
            q, so = source.read_w8((e, e + 1), (2 * start, 2 * (start + local)), (0, moe.hidden_size))
            q, so = q[0], so[0]  # (2 * local, H) interleaved rows, (2 * local, H / 32, 2)
            param.data[e].copy_(torch.cat([q[0::2], q[1::2]]))  # [gate | up]
            moe.gate_up_proj_scale.data[e].copy_(torch.cat([so[0::2], so[1::2]]))
        else:
            q, so = source.read_w8((e, e + 1), (0, moe.hidden_size), (start, start + local))
            param.data[e].copy_(q[0])  # (H, local)
            moe.down_proj_scale.data[e].copy_(so[0])
