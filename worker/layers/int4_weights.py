"""Weight-only int4 parameters of the parallel linear layers, and how they are filled.

(Published 8-bit GPTQ / compressed-tensors checkpoints are read the same way, then laid out by
worker/layers/int8_groups.py: as int8 per channel, or as byte codes with group-wise scales and offsets.)

(``layer`` is typed ``Any`` here: the functions set and read the attributes they add to an
``nn.Module``, which mypy sees only as ``Tensor | Module``.)

An int4 layer holds ``weight`` ``(N_local, K_local / 2)`` uint8 (packed codes) and
``weight_scale`` ``(N_local, K_local / G, 2)`` float32 (scale and offset per group of ``G``
columns): the kernel's layout, worker/layers/int4_matmul.py (repacked into its tile layout,
``weight_scale`` then ``(N_local / 16, K_local / G, 2, 16)``, once the layer is loaded, where
the CPU's tile kernel takes it, AMX-INT8 or AVX512-VNNI: :func:`finish_int4_layer`). ``G`` is known when the first
weight arrives (a checkpoint's ``group_size``, or the rule below), so ``weight_scale`` is
allocated then. Every source is brought to an :class:`~worker.layers.int4_formats.Int4Tensor`
(codes, scales, zero points, ``g_idx``) and packed from it, with ``offset = -scale * zero``:
the zero points are kept exactly (asymmetric GPTQ / AWQ / compressed-tensors), no
dequantize-requantize.

* **From a float weight** (``--quantization int4``): round-to-nearest, symmetric, per
  output row and group of ``G`` input columns (``G`` = 128 where the full input size
  divides by 128, else 32; :data:`~tpserve.quantization_int4.RTN_GROUP_SIZE`), in float32:

      s = max_{k in group} |w[n, k]| / 7     q = clamp(round(w / s), -7, 7) + 8     w ~= s * (q - 8)

  (Frantar et al.'s RTN baseline, arXiv:2210.17323, table 1; a group of zeros gets s = 0).
  The error of a weight is at most ``s / 2``. Groups never cross a rank's input columns, so
  quantizing then splitting equals splitting then quantizing (a row-parallel rank whose
  input columns do not divide by ``G`` is refused).
* **From a 4-bit checkpoint**: the loader hands each packed tensor wrapped in a
  :class:`PackedPart`; a layer part's tensors are kept until all have arrived, then unpacked
  and checked (worker/layers/int4_formats.py) and this rank's rows (column-parallel) or
  columns (row-parallel) packed. Each rank reads whole packed tensors (4 bits a weight).
  A row-parallel rank's groups are its slice of the checkpoint's: ``min(G, K_local)``
  columns each (a group spanning ranks, channel-wise, keeps its scale on each).
* **Act-order GPTQ** (``desc_act``, a ``g_idx`` other than ``k // G``): the input columns
  are reordered by group (stable sort of ``g_idx``), so every group is contiguous again,
  and the layer keeps the permutation (``input_perm``) to gather ``x``'s columns before
  the matmul; exact. Fused parts (q/k/v, gate/up) must share their ``g_idx`` (GPTQ
  computes it from the shared input); a row-parallel rank needs whole groups among its
  input columns, else the layer is refused at load naming the tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from tpserve.quantization_int4 import RTN_GROUP_SIZE, RTN_SMALL_GROUP_SIZE, Int4Format
from worker.layers.int4_formats import PARTS, Int4Tensor, required_parts, unpack_layer
from worker.layers.int4_matmul import BLOCK, pack_codes, pack_tiles, repack_tile_stack, tile_layout_applies
from worker.layers.int8_groups import write_8bit
from worker.layers.weights import CheckpointSource, check_finite_scales, check_shape, new_parameter, read_narrow, source_shape

RTN_MAX = 7


class PackedPart:
    """A checkpoint tensor of a 4-bit layer: its ``source``, which ``part`` it is, the format and its name."""

    def __init__(self, source: CheckpointSource, part: str, fmt: Int4Format, name: str) -> None:
        self.source, self.part, self.fmt, self.name = source, part, fmt, name

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        return self.source[tuple(slice(None) for _ in source_shape(self.source))]


def rtn_group_size(input_size: int) -> int:
    """``--quantization int4``'s group size for a layer of ``input_size`` (full) input columns."""
    return RTN_GROUP_SIZE if input_size % RTN_GROUP_SIZE == 0 else RTN_SMALL_GROUP_SIZE


def quantize_rtn(w: torch.Tensor, group: int) -> Int4Tensor:
    """Round-to-nearest symmetric int4 of ``w (N, K)`` (formula in the module docstring).

    Raises:
        ValueError: ``group`` does not divide ``K``; a NaN or an infinity in ``w`` (:func:`check_finite_scales`).
    """
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 group size {group} does not divide the input size {k}")
    wg = w.float().reshape(n, k // group, group)
    scales = check_finite_scales(wg.abs().amax(dim=2) / RTN_MAX)  # (N, groups)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (torch.round(wg / divisor[:, :, None]).clamp_(-RTN_MAX, RTN_MAX) + 8).to(torch.uint8).reshape(n, k)
    return Int4Tensor(codes, scales, torch.full_like(scales, 8.0), torch.arange(k) // group)


def new_int4_weights(layer: Any, shape: tuple[int, int], device: torch.device) -> None:
    """Give ``layer`` a packed ``weight`` for a ``shape (N, K)`` float weight and an empty ``weight_scale``.

    Raises:
        ValueError: ``K`` is not a multiple of 32 (the kernel's block).
    """
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"int4 needs each rank's input size to be a multiple of {BLOCK}: a linear layer of {n} "
                         f"outputs has {k} input columns on this rank (its input width, over the tensor-parallel "
                         f"size where the layer splits its input); serve the model with --quantization int8, "
                         f"which takes any width")
    layer.weight = new_parameter((n, k // 2), torch.uint8, device, layer.weight_loader)
    layer.weight_scale = new_parameter((n, 0, 2), torch.float32, device, layer.weight_loader)
    layer.weight_scale.computed_shard_ids = set()
    layer.int4_pending = {}  # shard id -> {part: (tensor, name)} until the part's tensors are all read
    layer.input_perm = None  # act-order: (K_local,) int64, x's columns in the packed order
    layer.int8_groups = False  # an 8-bit checkpoint's group-wise codes, a byte each (int8_groups.py)


def hold_unquantized(layer: Any) -> None:
    """Hold an int4 layer as a float one: a packed checkpoint stores this layer unquantized (its config's
    ``ignore`` list or narrower ``targets`` leave it out), so it is served as stored, never quantized here.

    ``weight`` becomes ``(N, K)`` in ``layer.float_dtype``, loaded by the float path; ``weight_scale`` is
    dropped (marked computed, so the loader does not ask the checkpoint for it).
    """
    n, half = layer.weight.shape
    layer.weight.data = torch.empty((n, 2 * half), dtype=layer.float_dtype, device=layer.weight.device)
    scale = layer.weight_scale
    scale.computed_shard_ids = set(scale.shard_ids)
    layer.weight_scale = None
    layer.int4_pending = None
    layer.input_perm = None


def load_int4_rows(layer: Any, source: CheckpointSource, total_rows: int, start: int, size: int,
                   offset: int, shard_id: object) -> None:
    """Column-parallel: rows ``[start, start + size)`` of a (part's) weight into rows ``[offset, ...)``.

    A float source (``--quantization int4``) is read for those rows only and quantized (RTN).
    """
    bytes_per_code = layer.weight.dtype == torch.int8 or layer.int8_groups  # 8-bit layouts (int8_groups.py)
    k = layer.weight.shape[1] * (1 if bytes_per_code else 2)
    if not isinstance(source, PackedPart):
        check_shape(source, (total_rows, k))
        _write(layer, quantize_rtn(read_narrow(source, 0, start, size), rtn_group_size(k)), offset, shard_id)
        return
    full = unpacked_part(layer, source, (total_rows, k), shard_id)
    if full is None:
        return
    t, perm = sort_by_group(Int4Tensor(full.codes[start:start + size], full.scales[start:start + size],
                                       full.zeros[start:start + size], full.g_idx))
    if perm is not None:
        if layer.input_perm is not None and not torch.equal(layer.input_perm, perm):
            raise ValueError(f"{source.name}: g_idx differs between the parts of a fused layer (q/k/v or "
                             "gate/up): not served")
        layer.input_perm = perm
    _write(layer, t, offset, shard_id, source.name)


def load_int4_columns(layer: Any, source: CheckpointSource, full_shape: tuple[int, int],
                      start: int, size: int) -> None:
    """Row-parallel: input columns ``[start, start + size)`` of the weight into the layer.

    A float source is read for those columns only and quantized (RTN) with the groups of the
    whole rows (they never cross ranks: refused otherwise).
    """
    if not isinstance(source, PackedPart):
        check_shape(source, full_shape)
        group = rtn_group_size(full_shape[1])
        if size % group:  # the groups are the whole rows' (the same weights at every degree): never cut by a rank
            raise ValueError(f"--quantization int4 groups of {group} columns do not split this rank's {size} "
                             f"input columns (the layer's {full_shape[1]} split over the ranks): serve it at a "
                             "smaller --tensor-parallel-size, or with --quantization int8, which takes any width")
        _write(layer, quantize_rtn(read_narrow(source, 1, start, size), group), 0, None)
        return
    full = unpacked_part(layer, source, full_shape, None)
    if full is None:
        return
    t, perm = column_slice(full, start, size, source.name.rpartition(".")[0])  # the layer: the cause is its g_idx
    if perm is not None:
        layer.input_perm = perm
    _write(layer, t, 0, None, source.name)


def sort_by_group(t: Int4Tensor) -> tuple[Int4Tensor, torch.Tensor | None]:
    """Act-order (a ``g_idx`` other than ``k // G``): ``t`` with its input columns sorted by group (a stable
    sort: every group contiguous again) and the permutation ``(K,)`` int64 (x's columns in the packed
    order); else ``(t, None)``."""
    if not t.act_order():
        return t, None
    perm = torch.argsort(t.g_idx, stable=True)
    return Int4Tensor(t.codes[:, perm], t.scales, t.zeros, t.g_idx[perm]), perm


def column_slice(full: Int4Tensor, start: int, size: int, name: str) -> tuple[Int4Tensor, torch.Tensor | None]:
    """Input columns ``[start, start + size)`` of a checkpoint weight with their groups, and the act-order
    permutation of those columns (None without act-order).

    A rank's groups are its part of the checkpoint's: ``min(G, size)`` columns each (a group
    spanning ranks, channel-wise, keeps its scale on each). Act-order: the columns sorted by
    group, each group whole among them.

    Raises:
        ValueError: the checkpoint's groups do not split the ``size`` columns, or act-order groups
            spread over other ranks' columns (names ``name``).
    """
    if full.act_order():
        g_idx = full.g_idx[start:start + size]
        perm = torch.argsort(g_idx, stable=True)
        present, counts = torch.unique(g_idx, return_counts=True)
        if not bool((counts == full.group_size).all()):
            raise ValueError(f"{name}: act-order (its g_idx, desc_act / actorder) spreads groups over the ranks' "
                             f"input columns at tensor_parallel_size={full.codes.shape[1] // size}: serve it at tp 1")
        return Int4Tensor(full.codes[:, start:start + size][:, perm].contiguous(), full.scales[:, present],
                          full.zeros[:, present], torch.arange(size) // full.group_size), perm
    group = full.group_size
    local = min(group, size)
    if (group % size if group > size else size % group) or start % local:
        raise ValueError(f"{name}: group_size={group} does not split this rank's {size} input columns")
    first = torch.arange(start, start + size, local) // group  # each local group's checkpoint group
    return Int4Tensor(full.codes[:, start:start + size].contiguous(), full.scales[:, first],
                      full.zeros[:, first], torch.arange(size) // local), None


def unpacked_part(layer: Any, source: PackedPart, shape: tuple[int, int], shard_id: object) -> Int4Tensor | None:
    """The weight part ``shard_id`` of ``source`` (its float shape ``(N, K)``) in common form, checked; None while
    the part's other tensors are unread (kept in ``layer.int4_pending`` until then).

    Raises:
        ValueError: a tensor read twice, parts of one layer in different formats, or a corrupt part (named:
            worker/layers/int4_formats.py).
    """
    known = getattr(layer, "int4_format", None)
    if known is not None and known != source.fmt:  # a fused layer's parts from config groups of other schemes
        raise ValueError(f"{source.name}: the parts of one fused layer (q/k/v, gate/up, one layer's experts) are "
                         f"stored in different formats ({known} and {source.fmt}): not served")
    layer.int4_format = source.fmt
    pending = layer.int4_pending.setdefault(shard_id, {})
    if source.part in pending:
        raise ValueError(f"{source.name} read twice")
    pending[source.part] = (source.read(), source.name)
    if not required_parts(source.fmt) <= set(pending):
        return None
    del layer.int4_pending[shard_id]
    parts = {part: tensor for part, (tensor, _) in pending.items()}
    names = {part: name for part, (_, name) in pending.items()}
    try:
        return unpack_layer(source.fmt, parts, names, shape)
    except ValueError as error:
        if any(name in str(error) for name in names.values()):
            raise  # it names the tensor already
        raise ValueError(f"{names['qweight']}: {error}") from error


def finish_int4_layer(layer: Any) -> None:
    """After every checkpoint tensor was read: refuse a layer part whose tensors are incomplete, then
    repack the layer into the tile layout where the tile kernel (AMX-INT8 or AVX512-VNNI) takes it
    (worker/layers/int4_matmul.py).

    Raises:
        ValueError: names the part's tensors that were read (the others are missing).
    """
    for pending in list(layer.int4_pending.values()):
        names = sorted(name for _, name in pending.values())
        stem = names[0].rpartition(".")[0]
        fmt = layer.int4_format
        suffixes = {part: suffix for suffix, part in PARTS[fmt.method].items()}
        missing = sorted(f"{stem}.{suffixes[part]}" for part in required_parts(fmt) - set(pending))
        raise ValueError(f"checkpoint is missing {missing} ({fmt.method}{' desc_act' if fmt.desc_act else ''}; "
                         f"read {names}): a corrupt checkpoint")
    # 8-bit checkpoints' layers (int8_groups.py: int8 per channel, or a byte a code) keep their layouts.
    # Stacked expert weights (worker/layers/moe_int4.py names them in ``int4_stacks``) are repacked expert by
    # expert, so ``linear_int4`` on one expert's slices takes the tile kernel (repack_tile_stack).
    for weight_name, scale_name in getattr(layer, "int4_stacks", ()):
        stack, stack_scale = getattr(layer, weight_name), getattr(layer, scale_name)
        if stack.shape[0] and tile_layout_applies(stack[0], stack_scale[0]):
            stack_scale.data = repack_tile_stack(stack.data, stack_scale.data)  # (E, N / 16, K / G, 2, 16)
    weight = getattr(layer, "weight", None)
    if weight is not None and weight.dtype == torch.uint8 and not layer.int8_groups and tile_layout_applies(
            weight, layer.weight_scale):
        # The tile kernel's order (worker/layers/int4_matmul.py, pack_tiles): same bytes, read in one stream.
        packed, scales = pack_tiles(layer.weight.data, layer.weight_scale.data)
        layer.weight.data.copy_(packed)
        layer.weight_scale.data = scales  # (N / 16, K / G, 2, 16)


def _write(layer: Any, t: Int4Tensor, offset: int, shard_id: object, name: str = "") -> None:
    """Pack ``t`` (this rank's rows, its input columns in packed order) into rows ``[offset, ...)``.

    8-bit checkpoints' codes go to worker/layers/int8_groups.py's layouts.
    """
    fmt = getattr(layer, "int4_format", None)
    if fmt is not None and fmt.bits == 8:
        write_8bit(layer, t, offset, shard_id, fmt, name.rpartition(".")[0])
        return
    size, k = t.codes.shape
    groups = t.scales.shape[1]
    if t.group_size % BLOCK:
        raise ValueError(f"int4 groups of {t.group_size} columns are not a multiple of {BLOCK} (the kernel's block)")
    scale = layer.weight_scale
    if scale.shape[1] == 0:
        scale.data = torch.empty((scale.shape[0], groups, 2), dtype=torch.float32, device=scale.device)
    elif scale.shape[1] != groups:
        raise ValueError(f"int4 parts of one layer have different group sizes ({k // scale.shape[1]} and "
                         f"{t.group_size})")
    layer.weight.data[offset:offset + size].copy_(pack_codes(t.codes))
    scale.data[offset:offset + size].copy_(t.scale_offset())
    scale.computed_shard_ids.add(shard_id)
