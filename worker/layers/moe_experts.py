"""The experts' SwiGLU MLPs over the tokens routed to them, grouped by expert (no per-token loop).

Every ``(token, choice)`` pair of a step is one *routed row*: ``T * k`` rows, row
``t * k + j`` being token ``t``'s ``j``-th expert ``ids[t, j]``. The rows are sorted
by expert (one stable sort), so each expert's rows are contiguous:

* CPU (and any device without Triton): one GEMM pair per expert with rows, on its
  contiguous group (:func:`grouped_experts_torch`); the group sizes are read on the host.
* CUDA: the grouped Triton kernel of worker/kernels/triton_moe.py, two launches per
  layer (gate/up, then down with the routing weight); its shapes depend on ``T`` only
  and nothing is read on the host, so a decode step stays capturable in a CUDA graph.

Options (gpt-oss): per-expert biases on the gate/up and down outputs, and another
activation than ``silu(gate) * up`` (worker/layers/clamped_swiglu.py); without them the
paths run exactly as before.

Both return, per token, ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` summed over
``j`` in routing order (most probable first), a partial of the tensor-parallel sum.
With expert parallelism (worker/layers/moe.py) an id equal to ``E`` (one past this
rank's stack) is a row of another rank's expert: it is not computed and adds zero.
Int8 and int4 experts (``--quantization int8`` / ``int4``, worker/layers/moe_int8.py, moe_int4.py) and an
8-bit checkpoint's grouped ones (worker/layers/moe_w8.py): the torch path runs the int8, int4 or w8 matmul per
expert (picked once a call by the stack: int8 codes, or uint8 codes of ``H / 2`` or ``H`` columns); the Triton
kernel dequantizes the layer's stack for its call.
``TPSERVE_TRITON_MOE=0`` keeps CUDA on the torch path, for A/B measurements.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from worker.layers.int4_matmul import int4_linear
from worker.layers.int8_groups import int8_groups_linear
from worker.layers.int8_matmul import int8_linear
from worker.layers.matmul import linear
from worker.layers.moe_combine import combine, expert_act


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, act: nn.Module = expert_act,
                    has_remote: bool = False, gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None, gate_up_perm: torch.Tensor | None = None,
                    down_perm: torch.Tensor | None = None) -> torch.Tensor:
    """Apply each token's ``k`` experts and sum them by their routing weights.

    Args:
        x: ``(T, H)`` activations.
        gate_up: ``(E, 2 * I, H)`` stacked ``[gate | up]`` weights (``I``: this rank's slice;
            ``E``: the experts this rank holds).
        down: ``(E, H, I)`` stacked down weights.
        ids: ``(T, k)`` int64 expert of each choice, in ``[0, E]`` (``E``: another rank's expert,
            only with ``has_remote``).
        weights: ``(T, k)`` routing weights (float32, or ``x.dtype`` to round as the family does).
        gate_up_bias: ``(E, 2 * I)`` added to each expert's gate/up output, or None.
        down_bias: ``(E, H)`` added to each expert's down output (before its routing weight), or None.
        act: ``(rows, 2 * I) [gate | up] -> (rows, I)``, the experts' activation.
        has_remote: ``ids`` may hold ``E`` (expert parallelism); those rows contribute zero.
        gate_up_scale: with int8 ``gate_up``: its ``(E, 2 * I)`` float32 per-output-channel scales
            (worker/layers/moe_int8.py); with int4 ``gate_up`` (uint8 ``(E, 2 * I, H / 2)`` packed codes):
            its ``(E, 2 * I, H / G, 2)`` float32 scales and offsets, or ``(E, 2 * I / 16, H / G, 2, 16)`` for
            a stack in the tile layout (worker/layers/moe_int4.py; ``linear_int4`` reads either per expert);
            None for float weights.
        down_scale: with int8 ``down``: its ``(E, H)`` float32 scales; with int4 ``down`` (``(E, H, I / 2)``
            uint8): ``(E, H, I / G, 2)`` or the tile layout's ``(E, H / 16, I / G, 2, 16)``; None for float weights.
            An 8-bit checkpoint's grouped experts (worker/layers/moe_w8.py): uint8 ``gate_up (E, 2 * I, H)`` and
            ``down (E, H, I)``, a code a byte, with ``(E, 2 * I, H / G, 2)`` and ``(E, H, I / G, 2)`` scales and
            offsets.
        gate_up_perm, down_perm: act-order int4 experts (worker/layers/moe_int4.py): ``(E, H)`` / ``(E, I)``
            int64, each expert's input columns in its packed order (gathered before its matmul); or None.

    Returns:
        ``(T, H)`` in ``x.dtype``.
    """
    if x.device.type == "cuda" and _triton_moe_enabled():
        from worker.kernels.triton_moe import grouped_experts_triton

        return grouped_experts_triton(x, gate_up, down, ids, weights, gate_up_bias=gate_up_bias,
                                      down_bias=down_bias, act=act, has_remote=has_remote,
                                      gate_up_scale=gate_up_scale, down_scale=down_scale,
                                      gate_up_perm=gate_up_perm, down_perm=down_perm)
    return grouped_experts_torch(x, gate_up, down, ids, weights, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                 act=act, gate_up_scale=gate_up_scale, down_scale=down_scale,
                                 gate_up_perm=gate_up_perm, down_perm=down_perm)


def _quantized_linear(gate_up: torch.Tensor, hidden: int):
    """The matmul of a quantized stack: int8 codes (``linear_int8``), a byte a code with group scales (an 8-bit
    checkpoint's grouped experts, ``H`` columns: ``linear_w8``) or packed 4-bit codes (``H / 2``: ``linear_int4``)."""
    if gate_up.dtype == torch.int8:
        return int8_linear
    return int8_groups_linear if gate_up.shape[-1] == hidden else int4_linear


def _triton_moe_enabled() -> bool:
    return os.environ.get("TPSERVE_TRITON_MOE", "1") != "0"


def grouped_experts_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
                          down_bias: torch.Tensor | None = None, act: nn.Module = expert_act,
                          gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                          gate_up_perm: torch.Tensor | None = None,
                          down_perm: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`grouped_experts` with one GEMM pair per expert on its sorted group (reads group sizes on the host).

    Int8 experts (scales given): each GEMM is :func:`~worker.layers.int8_matmul.int8_linear` on the
    expert's int8 rows and scales, as a dense int8 layer's; int4 experts (uint8 codes):
    :func:`~worker.layers.int4_matmul.int4_linear` (a few rows: the kernel's GEMV paths; more than 64:
    it dequantizes the expert once and multiplies); act-order int4 experts gather their input columns first.

    Rows of id ``E`` (another rank's expert) sort last: they are neither gathered nor computed, and stay zero.
    """
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)  # (T * k,) routed rows
    order = torch.argsort(flat, stable=True)  # (T * k,) rows grouped by expert, in token order within one
    counts = torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]  # rows per held expert, on the host
    held = sum(counts)
    qlinear = _quantized_linear(gate_up, x.shape[-1])  # used with scales only
    every_row = held == flat.shape[0]  # always without expert parallelism
    order_held = order if every_row else order[:held]  # (held,)
    xs = x[order_held // top_k]  # (held, H) each row's token
    out_sorted = torch.empty(held, down.shape[1], dtype=x.dtype, device=x.device)  # (held, H)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gu_bias = None if gate_up_bias is None else gate_up_bias[expert]
            d_bias = None if down_bias is None else down_bias[expert]
            if gate_up_scale is None or down_scale is None:
                h = act(linear(xs[rows], gate_up[expert], gu_bias))  # (count, I)
                out_sorted[rows] = linear(h, down[expert], d_bias)  # (count, H)
            else:
                xe = xs[rows] if gate_up_perm is None else xs[rows][:, gate_up_perm[expert]]  # (count, H) packed order
                h = act(qlinear(xe, gate_up[expert], gate_up_scale[expert], gu_bias))  # (count, I)
                if down_perm is not None:
                    h = h[:, down_perm[expert]]  # (count, I) in down's packed order
                out_sorted[rows] = qlinear(h, down[expert], down_scale[expert], d_bias)  # (count, H)
            start += count
    out = (torch.empty if every_row else torch.zeros)(flat.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    out[order_held] = out_sorted  # (T * k, H) back in row order t * k + j; other ranks' rows zero
    return combine(out.view(num_tokens, top_k, -1), weights)
