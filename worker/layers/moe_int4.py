"""Weight-only int4 routed experts: ``--quantization int4``, and 4-bit checkpoints' per-expert modules.

Each expert's projections are held as a dense int4 layer's (worker/layers/int4_weights.py,
the kernel's layout of worker/layers/int4_matmul.py): 4-bit codes packed two a byte in blocks
of 32 columns, and a float32 ``(s, o)`` pair per output row and group of ``G`` input columns,
``w = s * q + o``. The parameters of :class:`~worker.layers.moe.FusedMoE` become (``E``:
experts this rank holds, ``I``: this rank's width of one expert, ``G1`` / ``G2`` the groups of
gate/up and down)::

    gate_up_proj (E, 2 * I, H / 2) uint8   gate_up_proj_scale (E, 2 * I, H / G1, 2) float32   [gate | up] rows
    down_proj    (E, H, I / 2)     uint8   down_proj_scale    (E, H, I / G2, 2)     float32

So an expert weight costs 4 bits plus ``64 / G`` bits of scale and offset: 1/8 of float32 plus
``2 / G`` (0.1875 at ``G = 32``, 0.14 at 128). The groups are known when the first tensor of a
stack arrives (RTN's rule, or the checkpoint's ``group_size``), so the scales are allocated then.

Sources, one expert tensor at a time:

* **A float checkpoint** (``--quantization int4``): round-to-nearest, symmetric, groups of 128
  input columns (32 where the full input size does not divide by 128), as a dense layer's
  (:func:`~worker.layers.int4_weights.quantize_rtn`). Gate/up rows are output channels
  (column-parallel: a rank quantizes the rows it reads); down's groups are of its input
  columns, which never cross ranks (a rank whose columns do not divide by the group is refused,
  as for a dense row-parallel layer), so quantizing then splitting equals splitting then
  quantizing and the ranks' partials sum to tp 1's up to summation order.
* **A 4-bit checkpoint** with one module per expert (GPTQ ``experts.{e}.gate_proj.qweight`` /
  ``qzeros`` / ``scales`` (/ ``g_idx``), AWQ's, compressed-tensors' ``weight_packed`` /
  ``weight_scale`` / ``weight_zero_point`` / ``weight_shape``; Mixtral's ``w1/w3/w2``): the
  loader renames an expert's packed tensors to its ``weight`` and hands them over as
  :class:`~worker.layers.int4_weights.PackedPart` s; once an expert part has them all they are
  unpacked and checked (worker/layers/int4_formats.py, the format's reference dequantization,
  zero points kept exactly: ``o = -s * z``) and this rank's rows (gate/up) or columns (down,
  :func:`~worker.layers.int4_weights.column_slice`) packed.
* **Act-order GPTQ experts** (``desc_act``: a ``g_idx`` other than ``k // G``): as for a dense
  layer, an expert's input columns are sorted by group (every group contiguous again) and the
  permutation kept, per expert: ``gate_up_perm (E, H)`` and ``down_perm (E, I)`` int64 (identity
  rows for experts stored in order; None while no expert needs one), and the experts path gathers
  each expert's input columns before its matmul: exact. An expert's gate and up share their
  ``g_idx`` (GPTQ derives it from their common input; refused otherwise), and a tensor-parallel
  rank must hold whole groups among its down columns (a random act order does not: refused,
  naming the tensor; tp 1 or ``--enable-expert-parallel``, which holds whole experts, serve it).

Expert parallelism holds whole experts: the same formulas at full width; another rank's experts
are never read (their scales are marked computed so the loader does not ask for them).

The tile layout: once loaded (:func:`~worker.layers.int4_weights.finish_int4_layer`, listed in
``moe.int4_stacks``), a stack whose expert matrices qualify for a dense layer's tile layout
(:func:`~worker.layers.int4_matmul.tile_layout_applies`: an AMX-INT8 or AVX512-VNNI CPU, rows a multiple of 16,
columns and groups of 128) is repacked expert by expert
(:func:`~worker.layers.int4_matmul.repack_tile_stack`): the codes keep their ``(E, N, K / 2)``
shape with each expert's bytes in the tile order, the scales become ``(E, N / 16, K / G, 2, 16)``.
gate_up and down are judged apart (down's groups may be 32 where gate_up's are 128). The
act-order permutations gather input columns of x, so they are the same in either layout; an
expert-parallel rank repacks the whole experts it holds.

Compute (worker/layers/moe_experts.py): the torch path runs
:func:`~worker.layers.int4_matmul.int4_linear` per expert on its rows, the compiled
``linear_int4`` on the CPU, which picks its kernel by the expert slice's scales: the tile layout's
4-D ones take the tile kernel (AMX at every row count; VNNI up to 16 rows, then dequantized rows or
the dequantized expert); row-major ones take the GEMV paths for a
decode step's few rows (codes widened in registers, 4 bits a weight read), and more than 64 rows
(prefill) dequantize the expert once and multiply with ``at::matmul`` (the kernel's own switch).
The grouped Triton kernel on CUDA takes float weights: :func:`dequantize_int4_experts` widens one
layer's stack for the call (either layout), as for int8.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.layers.int4_formats import Int4Tensor
from worker.layers.int4_matmul import BLOCK, TILE_ROWS, dequantize, pack_codes
from worker.layers.int4_weights import (PackedPart, column_slice, quantize_rtn, rtn_group_size, sort_by_group,
                                        unpacked_part)
from worker.layers.weights import CheckpointSource, check_shape, new_parameter, read_narrow


def new_int4_experts(moe: Any, held: int, local: int, hidden: int, device: torch.device) -> None:
    """Give ``moe`` packed ``gate_up_proj`` / ``down_proj`` and empty scales (shapes in the module docstring).

    ``moe`` supplies ``weight_loader`` (a :class:`~worker.layers.moe.FusedMoE`); the caller sets
    the weights' ``shard_ids`` and then calls :func:`~worker.layers.moe_int8.set_scale_shards`.

    Raises:
        ValueError: ``hidden`` or this rank's expert width ``local`` not a multiple of 32 (the kernel's block).
    """
    for name, size in (("hidden_size", hidden), ("this rank's moe_intermediate_size", local)):
        if size % BLOCK:
            hint = "--quantization int8" if name == "hidden_size" else (
                f"--quantization int8, or a tensor-parallel degree that leaves each rank a multiple of {BLOCK}, or "
                f"--enable-expert-parallel (whole experts per rank; a shared expert's and the dense layers' widths "
                f"still split over the ranks and need the same)")
            raise ValueError(f"--quantization int4 experts need {name} to be a multiple of {BLOCK}, got {size}; "
                             f"serve them with {hint}")
    moe.gate_up_proj = new_parameter((held, 2 * local, hidden // 2), torch.uint8, device, moe.weight_loader)
    moe.down_proj = new_parameter((held, hidden, local // 2), torch.uint8, device, moe.weight_loader)
    moe.gate_up_proj_scale = new_parameter((held, 2 * local, 0, 2), torch.float32, device, moe.weight_loader)
    moe.down_proj_scale = new_parameter((held, hidden, 0, 2), torch.float32, device, moe.weight_loader)
    moe.int4_pending = {}  # (e, kind) -> {part: (tensor, name)} until the expert part's tensors are all read
    moe.input_perm = None  # no layer-wide input gather: act-order experts keep theirs in gate_up_perm / down_perm
    moe.int4_gate_up_orders = {}  # slot -> the first of gate / up's act-order permutation (or None)
    # Repacked expert by expert into the tile layout once loaded (finish_int4_layer), where the shapes allow.
    moe.int4_stacks = (("gate_up_proj", "gate_up_proj_scale"), ("down_proj", "down_proj_scale"))


def hold_unquantized_experts(moe: Any) -> None:
    """Hold a MoE layer built for packed experts as float experts: the checkpoint stores every expert of this
    layer unquantized (its ``ignore`` list, GPTQModel's ``-:`` rules), so they are served as stored.

    The stacks become ``(E, 2 * I, H)`` and ``(E, H, I)`` in ``moe.float_dtype``, loaded by the float path; the
    scales are dropped (marked computed, so the loader does not ask the checkpoint for them).
    """
    for weight_name in ("gate_up_proj", "down_proj"):
        weight, scale = getattr(moe, weight_name), getattr(moe, f"{weight_name}_scale")
        held, rows, half = weight.shape
        weight.data = torch.empty((held, rows, 2 * half), dtype=moe.float_dtype, device=weight.device)
        scale.computed_shard_ids = set(scale.shard_ids)
        setattr(moe, f"{weight_name}_scale", None)
    moe.int4 = False
    moe.int4_pending = None
    moe.int4_stacks = ()


def load_int4_expert(moe: Any, param: nn.Parameter, source: CheckpointSource, shard_id: tuple[int, str],
                     slot: int, start: int, local: int) -> None:
    """Quantize (float) or repack (4-bit checkpoint) expert ``shard_id = (e, kind)`` into slot ``slot`` of ``param``.

    Args:
        moe: the :class:`~worker.layers.moe.FusedMoE` (``hidden_size``, ``intermediate_size``, the scales).
        param: ``moe.gate_up_proj`` or ``moe.down_proj`` (uint8).
        source: the checkpoint's float tensor ``(I_full, H)`` for gate/up, ``(H, I_full)`` for down,
            or one :class:`~worker.layers.int4_weights.PackedPart` of its 4-bit tensors.
        slot: the expert's index in this rank's stack.
        start, local: this rank's range of the intermediate dimension.

    Raises:
        ValueError: a float tensor of another shape; RTN groups that do not split this rank's down
            columns; a corrupt 4-bit expert, or act-order gate and up with different ``g_idx`` or
            groups spread over other ranks' down columns (named).
    """
    kind = shard_id[1]
    full_shape = (moe.hidden_size, moe.intermediate_size) if kind == "down" else (moe.intermediate_size,
                                                                                  moe.hidden_size)
    if isinstance(source, PackedPart):
        full = unpacked_part(moe, source, full_shape, shard_id)
        if full is None:
            return  # the expert part's other tensors are still unread
        t = rank_part(moe, full, kind, slot, start, local, source.name)
    else:
        check_shape(source, full_shape)
        if kind == "down":
            group = rtn_group_size(moe.intermediate_size)
            if local % group:
                raise ValueError(f"--quantization int4 groups of {group} columns do not split this rank's {local} "
                                 "expert columns: use --enable-expert-parallel (whole experts per rank) or a "
                                 "smaller --tensor-parallel-size")
            t = quantize_rtn(read_narrow(source, 1, start, local), group)  # (H, local) codes
        else:
            t = quantize_rtn(read_narrow(source, 0, start, local), rtn_group_size(moe.hidden_size))  # (local, H)
    scale = moe.down_proj_scale if kind == "down" else moe.gate_up_proj_scale
    offset = local if kind == "up" else 0
    _write(param, scale, t, slot, offset)
    scale.computed_shard_ids.add(shard_id)


def rank_part(moe: Any, full: Int4Tensor, kind: str, slot: int, start: int, local: int, name: str) -> Int4Tensor:
    """This rank's part of an unpacked expert tensor (gate/up rows or down columns ``[start, start + local)``),
    its input columns in packed order, the act-order permutation recorded (:func:`keep_expert_order`).

    Raises:
        ValueError: act-order groups spread over the tensor-parallel ranks' down columns, or gate and up in
            different orders (names ``name``).
    """
    if kind == "down":
        try:
            t, perm = column_slice(full, start, local, name.rpartition(".")[0])  # the expert: its g_idx is the cause
        except ValueError as error:
            raise ValueError(f"{error} (experts: --enable-expert-parallel holds whole ones)") from error
    else:
        t, perm = sort_by_group(Int4Tensor(full.codes[start:start + local], full.scales[start:start + local],
                                           full.zeros[start:start + local], full.g_idx))
    keep_expert_order(moe, kind, slot, perm, name)
    return t


def keep_expert_order(moe: Any, kind: str, slot: int, perm: torch.Tensor | None, name: str) -> None:
    """Record expert ``slot``'s act-order permutation of its gate/up or down input (see the module docstring;
    8-bit experts too, worker/layers/moe_w8.py).

    Raises:
        ValueError: gate and up of one expert in different column orders (names ``name``).
    """
    if kind != "down":
        if slot not in moe.int4_gate_up_orders:
            moe.int4_gate_up_orders[slot] = perm
        else:
            first = moe.int4_gate_up_orders.pop(slot)
            if (first is None) != (perm is None) or (perm is not None and not torch.equal(first, perm)):
                raise ValueError(f"{name}: g_idx differs between the expert's gate and up projections: not served")
    if perm is None:
        return
    attr = "down_perm" if kind == "down" else "gate_up_perm"
    if getattr(moe, attr) is None:  # identity rows for the experts stored in order
        held = moe.num_local_experts
        setattr(moe, attr, torch.arange(perm.numel(), device=moe.ctx.device).repeat(held, 1))  # (E, K) int64
    getattr(moe, attr)[slot].copy_(perm)


def _write(param: nn.Parameter, scale: nn.Parameter, t: Int4Tensor, slot: int, offset: int) -> None:
    """Pack ``t`` into rows ``[offset, offset + N)`` of expert ``slot``; allocate the stack's scales at the first."""
    size = t.codes.shape[0]
    ready_group_scales(scale, t, "int4")
    param.data[slot, offset:offset + size].copy_(pack_codes(t.codes))
    scale.data[slot, offset:offset + size].copy_(t.scale_offset())


def ready_group_scales(scale: nn.Parameter, t: Int4Tensor, what: str) -> None:
    """A stack's ``(E, N, groups, 2)`` scales allocated at its first expert part (zero groups until then).

    Raises:
        ValueError: ``t``'s groups not a multiple of 32 columns (the kernels' block), or another group size than
            the layer's earlier parts (``what`` starts the message: ``"int4"``, or the tensor and ``8-bit``).
    """
    if t.group_size % BLOCK:
        raise ValueError(f"{what} groups of {t.group_size} columns are not a multiple of {BLOCK} (the kernel's block)")
    groups = t.scales.shape[1]
    if scale.shape[2] == 0:
        held, rows = scale.shape[:2]
        scale.data = torch.zeros((held, rows, groups, 2), dtype=torch.float32, device=scale.device)
    elif scale.shape[2] != groups:
        raise ValueError(f"{what} experts of one layer have different group sizes "
                         f"({t.codes.shape[1] // scale.shape[2]} and {t.group_size})")


def dequantize_int4_experts(q: torch.Tensor, scale_offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q (E, N, K / 2) uint8`` -> ``(E, N, K)`` weights in ``dtype``, either layout of the stack.

    ``scale_offset`` is ``(E, N, K / G, 2)`` float32 (row-major) or ``(E, N / 16, K / G, 2, 16)`` (the
    tile layout, each expert repacked on its own: the flattened stack is one tile-layout matrix of
    ``E * N`` rows, as every expert's rows are whole blocks of 16). ``w = s * q + o`` per group, computed
    in float32 and rounded once to ``dtype``.
    """
    experts, rows, half = q.shape
    if scale_offset.dim() == 5:
        flat_scale = scale_offset.reshape(experts * rows // TILE_ROWS, *scale_offset.shape[2:])  # (E N / 16, ., 2, 16)
    else:
        flat_scale = scale_offset.reshape(experts * rows, -1, 2)  # (E * N, K / G, 2)
    w = dequantize(q.reshape(experts * rows, half), flat_scale)  # (E * N, K)
    return w.reshape(experts, rows, 2 * half).to(dtype)


def unpermute_columns(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """``w (E, N, K)`` with each expert's input columns in its packed (act-order) order -> the checkpoint's order.

    ``perm (E, K)``: packed column ``j`` of expert ``e`` is input column ``perm[e, j]``; None: ``w`` as it is.
    """
    if perm is None:
        return w
    return torch.empty_like(w).scatter_(2, perm[:, None, :].expand_as(w), w)  # (E, N, K)
