"""Tensor-parallel linear layers (Megatron-LM layout, arXiv:1909.08053, section 3).

``y = x @ W.T + b`` with ``W`` of shape ``(output_size, input_size)`` split across
the ``tp_size`` ranks of a :class:`~worker.parallel_state.ParallelContext`:

* column-parallel: rank ``r`` holds output rows ``[r * out/tp, (r + 1) * out/tp)``
  and produces that slice of ``y``; no communication;
* row-parallel: rank ``r`` holds input columns ``[r * in/tp, (r + 1) * in/tp)``,
  consumes the matching slice of ``x`` (the output of a column-parallel layer) and
  produces a partial ``y``; the partials are summed by an all-reduce in
  ``forward()``, then the bias is added once.

Fused variants load several checkpoint tensors into one parameter:
``MergedColumnParallelLinear`` (``gate_proj`` + ``up_proj``) and
``QKVParallelLinear`` (``q_proj`` + ``k_proj`` + ``v_proj``, split by head, KV
heads replicated when ``tp_size > total_num_kv_heads``). Each parameter's
``weight_loader(param, source, shard_id)`` reads only this rank's rows or columns
of the checkpoint tensor; ``shard_ids`` lists the ``shard_id`` values it expects.
A fused layer also takes ``shard_id=None``: the checkpoint stores it fused too
(Phi-3's ``qkv_proj``, ``gate_up_proj``), its parts' rows one after the other.

``quantization="int8"``: ``weight`` is int8 with a float32 ``weight_scale`` per
output channel (worker/layers/int8_weights.py: column-parallel layers hold their
rows' scales, row-parallel ones the full ``(output_size,)`` scales), and the matmul
is :func:`~worker.layers.int8_matmul.int8_linear`; activations stay in ``dtype``.

``quantization="int4"``: ``weight`` is packed 4-bit codes (uint8) with a float32
``weight_scale`` of (scale, offset) per row and group of input columns
(worker/layers/int4_weights.py: quantized at load from a float checkpoint, or repacked
from a GPTQ / AWQ / compressed-tensors checkpoint), and the matmul is
:func:`~worker.layers.int4_matmul.int4_linear`, after gathering ``x``'s columns when the
checkpoint is act-order GPTQ (``input_perm``). An 8-bit GPTQ / compressed-tensors checkpoint's
layers are int4 layers re-laid out at load (worker/layers/int8_groups.py): int8 per channel
(then the int8 matmul), or byte codes with group-wise scales and offsets (``int8_groups``: the w8 matmul).

``quantization="fp8"`` (an FP8 checkpoint): ``weight`` is the checkpoint's float8 e4m3 codes with a
float32 ``weight_scale`` per row and group of input columns (worker/layers/fp8_weights.py), and the
matmul is :func:`~worker.layers.fp8_weights.fp8_linear`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpserve.quantization import Quantization
from worker.layers.fp8_weights import fp8_linear, load_fp8_columns, load_fp8_rows, new_fp8_weights
from worker.layers.int4_matmul import int4_linear
from worker.layers.int4_weights import PackedPart, load_int4_columns, load_int4_rows, new_int4_weights
from worker.layers.int8_matmul import int8_linear
from worker.layers.int8_groups import int8_groups_linear
from worker.layers.int8_weights import load_columns, load_rows, new_int8_weights
from worker.layers.lora import LoRAWeights
from worker.layers.matmul import linear
from worker.layers.weights import CheckpointSource, RowRange, load_fused, load_replicated, new_parameter
from worker.parallel_state import ParallelContext


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, the per-rank share of a size ``what`` split across ``denominator`` ranks.

    Raises ValueError when it does not split evenly (the config names the size and the parallel size)."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


_divide = divide  # this module's call sites' name (public ``divide`` is what other modules import)


def _set_shard_ids(layer: nn.Module, shard_ids: tuple) -> None:
    """The checkpoint shards every parameter of ``layer`` expects (bias and scale: one per weight shard)."""
    for param in (layer.weight, layer.bias, layer.weight_scale):
        if param is not None:
            param.shard_ids = shard_ids


def _matmul(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for a float, int8, int4 or fp8 layer: ``(T, K) -> (T, N)``, ``x.dtype``."""
    if layer.weight_scale is None:
        return linear(x, layer.weight, bias)
    if layer.weight.dtype == torch.float8_e4m3fn:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)
    if layer.weight.dtype == torch.uint8:
        if layer.input_perm is not None:
            x = x[:, layer.input_perm]  # (T, K) in the packed column order (act-order GPTQ)
        if layer.int8_groups:
            return int8_groups_linear(x, layer.weight, layer.weight_scale, bias)  # group-wise 8-bit codes
        return int4_linear(x, layer.weight, layer.weight_scale, bias)
    return int8_linear(x, layer.weight, layer.weight_scale, bias)


def _new_weights(layer: Any, shape: tuple[int, int], num_scales: int, dtype: torch.dtype,
                 quantization: Quantization | None) -> None:
    """The layer's ``weight`` (and ``weight_scale``, None for a float layer) for a ``shape (N, K)`` weight."""
    layer.weight_scale = None
    if quantization == "int8":
        new_int8_weights(layer, shape, num_scales, layer.ctx.device)
    elif quantization == "int4":
        new_int4_weights(layer, shape, layer.ctx.device)
        layer.float_dtype = dtype  # a packed checkpoint's unquantized layer is held in it (hold_unquantized)
    elif quantization == "fp8":
        new_fp8_weights(layer, shape, layer.ctx.device)
        layer.float_dtype = dtype  # a layer the checkpoint stores unquantized is held in it (hold_unquantized_fp8)
    else:
        layer.weight = new_parameter(shape, dtype, layer.ctx.device, layer.weight_loader)


def _load_rows(layer: nn.Module, param: nn.Parameter, source: CheckpointSource, total_rows: int, start: int,
               size: int, offset: int = 0, shard_id: object = None) -> None:
    """Column-parallel rows of ``source`` into ``param``: int4 weights by int4_weights.py, the rest by int8_weights.py."""
    if isinstance(source, RowRange) and isinstance(source.source, PackedPart):
        raise ValueError(f"{source.source.name}: a fused 4-bit tensor (several layers' rows in one) is not served")
    if getattr(layer, "int4_pending", None) is not None and param is layer.weight:
        load_int4_rows(layer, source, total_rows, start, size, offset, shard_id)
        return
    if getattr(layer, "fp8", False) and param is layer.weight:
        load_fp8_rows(layer, source, total_rows, start, size, offset, shard_id)
        return
    load_rows(layer, param, source, total_rows, start, size, offset, shard_id)


class ColumnParallelLinear(nn.Module):
    """``y[:, rank's slice] = x @ W[rank's rows].T + b[rank's slice]``.

    Args:
        input_size: features of ``x`` (whole, replicated on every rank).
        output_size: features of the full ``y``; must divide by ``tp_size``.
        ctx: the tensor-parallel group.
        bias: whether the layer has a bias.
        dtype: parameter (bias, float weight) and activation dtype.
        quantization: None, or "int8" (int8 weight, float32 scale per output row).

    Shapes: ``x (T, input_size) -> (T, output_size / tp_size)``, ``x.dtype``.

    ``lora``: the layer's adapter slots (worker/layers/lora.py) when ``--enable-lora`` targets it, else None.
    """

    lora: LoRAWeights | None = None

    def __init__(
        self, input_size: int, output_size: int, ctx: ParallelContext, *, bias: bool, dtype: torch.dtype,
        quantization: Quantization | None = None, reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.reduce_results = reduce_results
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, ctx.tp_size, "output_size")
        shape = (self.output_size_per_partition, input_size)
        _new_weights(self, shape, shape[0], dtype, quantization)  # int8: the scales split with the rows
        self.bias = new_parameter(shape[:1], dtype, ctx.device, self.weight_loader) if bias else None
        _set_shard_ids(self, (None,))

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy rows ``[rank * out/tp, (rank + 1) * out/tp)`` of the full weight, bias or scale."""
        size = self.output_size_per_partition
        _load_rows(self, param, source, self.output_size, self.ctx.tp_rank * size, size, shard_id=shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(self, x, self.bias)  # (T, output_size / tp)
        if self.lora is not None and self.lora.step.row_slots is not None:  # adapter rows (worker/layers/lora.py)
            y = self.lora.add(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (``gate_proj`` and ``up_proj``).

    Rank ``r``'s weight is ``[W_0[r's rows]; W_1[r's rows]; ...]``, so its output
    is ``(T, sum(output_sizes) / tp_size)`` laid out as the local slice of
    output 0, then of output 1, and so on. ``shard_id`` is the output's index.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], ctx: ParallelContext, *, bias: bool, dtype: torch.dtype,
        quantization: Quantization | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            _divide(size, ctx.tp_size, "output_size")
        super().__init__(input_size, sum(output_sizes), ctx, bias=bias, dtype=dtype, quantization=quantization)
        _set_shard_ids(self, tuple(range(len(output_sizes))))

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's rows of output ``shard_id`` (an int; None: all outputs, fused) into ``param``."""
        if shard_id is None:
            load_fused(self.weight_loader, param, source, list(enumerate(self.output_sizes)))
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an output index < {len(self.output_sizes)}, got {shard_id!r}")
        tp = self.ctx.tp_size
        size = self.output_sizes[shard_id] // tp
        offset = sum(self.output_sizes[:shard_id]) // tp
        _load_rows(self, param, source, self.output_sizes[shard_id], self.ctx.tp_rank * size, size, offset, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused ``q_proj``, ``k_proj``, ``v_proj``, split by attention head.

    Rank ``r`` holds query heads ``[r * num_heads, (r + 1) * num_heads)`` with
    ``num_heads = total_num_heads / tp_size``, and ``num_kv_heads`` key/value
    heads: ``total_num_kv_heads / tp_size`` of them starting at
    ``r * num_kv_heads`` when ``tp_size <= total_num_kv_heads``; otherwise one,
    head ``r // (tp_size / total_num_kv_heads)``, replicated on that many ranks
    (the KV head the rank's query heads attend to under GQA, Ainslie et al. 2023,
    arXiv:2305.13245). ``shard_id`` is ``"q"``, ``"k"`` or ``"v"``.

    Shapes: ``x (T, hidden_size) -> (T, (num_heads + 2 * num_kv_heads) * head_size)``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        ctx: ParallelContext,
        *,
        bias: bool,
        dtype: torch.dtype,
        quantization: Quantization | None = None,
    ) -> None:
        tp = ctx.tp_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        if tp <= total_num_kv_heads:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = ctx.tp_rank * self.num_kv_heads
        else:
            if tp % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads={total_num_kv_heads}"
                )
            replicas = tp // total_num_kv_heads  # ranks sharing one KV head
            self.num_kv_heads = 1
            self.kv_head_start = ctx.tp_rank // replicas
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # The parent splits output_size by tp; give it the padded total so each
        # rank's part is exactly q_size + 2 * kv_size.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, ctx, bias=bias, dtype=dtype,
                         quantization=quantization)
        _set_shard_ids(self, ("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's heads of ``q_proj``/``k_proj``/``v_proj`` (``shard_id``) into ``param``.

        ``shard_id=None``: ``source`` is the fused ``qkv_proj`` (q's rows, then k's, then v's).
        """
        if shard_id is None:
            kv_rows = self.total_num_kv_heads * self.head_size
            load_fused(self.weight_loader, param, source,
                       [("q", self.total_num_heads * self.head_size), ("k", kv_rows), ("v", kv_rows)])
            return
        if shard_id == "q":
            total, start, size, offset = self.total_num_heads, self.ctx.tp_rank * self.q_size, self.q_size, 0
        elif shard_id in ("k", "v"):
            total, start, size = self.total_num_kv_heads, self.kv_head_start * self.head_size, self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _load_rows(self, param, source, total * self.head_size, start, size, offset, shard_id)


class ReplicatedLinear(nn.Module):
    """``y = x @ W.T + b`` with the whole ``W`` on every rank (no split, no communication).

    For the small projections every rank needs whole: multi-head latent attention's
    down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``; worker/layers/mla.py), whose
    outputs are normalised over their full width before the per-head up-projections.

    Args:
        input_size, output_size: ``W``'s ``(output_size, input_size)``.
        ctx: the tensor-parallel group (for the device).
        bias: whether the layer has a bias.
        dtype: parameter and activation dtype (float weights only).

    Shapes: ``x (T, input_size) -> (T, output_size)``, ``x.dtype``.
    """

    def __init__(self, input_size: int, output_size: int, ctx: ParallelContext, *, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight_scale = None
        self.weight = new_parameter((output_size, input_size), dtype, ctx.device, load_replicated)
        self.bias = new_parameter((output_size,), dtype, ctx.device, load_replicated) if bias else None
        _set_shard_ids(self, (None,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(self, x, self.bias)  # (T, output_size)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x[:, rank's slice] @ W[:, rank's columns].T) + b``.

    Args:
        input_size: features of the full ``x``; must divide by ``tp_size``.
        output_size: features of ``y`` (whole, replicated on every rank after the reduce).
        ctx: the tensor-parallel group.
        bias: whether the layer has a bias (replicated, added once after the reduce).
        dtype: parameter (bias, float weight) and activation dtype.
        quantization: None, or "int8" (int8 weight columns, the full ``(output_size,)``
            float32 scales of the whole rows, so every rank's partial sum has the same scale).
        reduce_results: False leaves the all-reduce (and the bias) to the caller, which
            sums this partial with others first (a MoE block's shared expert).

    Shapes: ``x (T, input_size / tp_size) -> (T, output_size)``, ``x.dtype``.

    ``lora``: as :class:`ColumnParallelLinear`'s (``A`` split by columns, added to the partial sum).
    """

    lora: LoRAWeights | None = None

    def __init__(
        self, input_size: int, output_size: int, ctx: ParallelContext, *, bias: bool, dtype: torch.dtype,
        quantization: Quantization | None = None, reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.reduce_results = reduce_results
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, ctx.tp_size, "input_size")
        shape = (output_size, self.input_size_per_partition)
        _new_weights(self, shape, output_size, dtype, quantization)
        self.bias = new_parameter((output_size,), dtype, ctx.device) if bias else None
        _set_shard_ids(self, (None,))

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy columns ``[rank * in/tp, (rank + 1) * in/tp)`` of the full weight, or the whole scale."""
        size = self.input_size_per_partition
        if getattr(self, "int4_pending", None) is not None and param is self.weight:
            load_int4_columns(self, source, (self.output_size, self.input_size), self.ctx.tp_rank * size, size)
            return
        if getattr(self, "fp8", False) and param is self.weight:
            load_fp8_columns(self, source, (self.output_size, self.input_size), self.ctx.tp_rank * size, size)
            return
        load_columns(self, param, source, (self.output_size, self.input_size), self.ctx.tp_rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(self, x, None)  # (T, output_size), this rank's partial sum
        if self.lora is not None and self.lora.step.row_slots is not None:  # partial: A split by columns
            y = self.lora.add(x, y)
        if not self.reduce_results:
            return y
        return self.reduce(y)  # (T, output_size)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial ``y (T, output_size)`` -> the layer's output: summed over ranks, plus the bias.

        :meth:`forward`'s second half, for a caller that computed the partial product itself
        (worker/layers/decode_block.py). The all-reduce is a collective: every rank calls it.
        """
        y = self.ctx.all_reduce(y)  # (T, output_size), summed over ranks
        if self.bias is not None:
            y = y + self.bias  # (T, output_size); once, not once per rank
        return y
