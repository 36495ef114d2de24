"""Weight-only int8 routed experts: ``--quantization int8`` on a mixture-of-experts model.

Each expert's projections are quantized exactly as a dense int8 layer's
(worker/layers/int8_weights.py, the same :func:`~worker.layers.int8_weights.quantize_rows`):
per output channel, symmetric, ``scale = max_k |w[n, k]| / 127`` in float32, so
``w[e] ~= q[e] * scale[e][:, None]``. The parameters of :class:`~worker.layers.moe.FusedMoE`
become (``E``: experts this rank holds, ``I``: this rank's width of one expert)::

    gate_up_proj (E, 2 * I, H) int8    gate_up_proj_scale (E, 2 * I) float32   [gate | up] rows
    down_proj    (E, H, I)     int8    down_proj_scale    (E, H)     float32

Sharding follows the dense layers. Gate/up rows are output channels: a rank quantizes
the rows it reads (column-parallel). Down's output channels are the ``H`` rows, of which a
tensor-parallel rank reads only its ``I / tp`` columns: its scales are those of the WHOLE
rows (:func:`~worker.layers.int8_weights.row_scales`, a load-time pass), so every rank's
partial carries the same scales and the all-reduced sum equals tp 1's up to summation
order (row-parallel). Expert parallelism holds whole experts: the same formulas at full
width, and another rank's experts are never read (their scales are marked computed so
the loader does not ask for them).

Sources: a float checkpoint, or an FP8 one that worker/dequantize.py hands over as
float32 (requantized here, one expert tensor at a time). Experts stored as int8 in the
checkpoint (a compressed-tensors MoE checkpoint) are refused with one line naming the tensor.

Compute (worker/layers/moe_experts.py): the grouped torch path runs
:func:`~worker.layers.int8_matmul.int8_linear` per expert (the compiled ``linear_int8``
on the CPU with float32 activations); the grouped Triton kernel on CUDA takes float
weights, so :func:`dequantize_experts` widens one layer's stack for that call (a
transient of ``E * 3 * I * H`` elements in the activation dtype, one layer at a time).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.layers.int8_weights import quantize_rows, row_scales
from worker.layers.weights import CheckpointSource, copy_into, new_parameter, read_narrow


def new_int8_experts(moe: Any, held: int, local: int, hidden: int, device: torch.device) -> None:
    """Give ``moe`` int8 ``gate_up_proj`` / ``down_proj`` and their float32 scales (shapes in the module docstring).

    ``moe`` supplies ``weight_loader``, ``num_experts`` and ``first_expert`` (a
    :class:`~worker.layers.moe.FusedMoE`); the caller sets the weights' ``shard_ids``
    and then calls :func:`set_scale_shards`.
    """
    moe.gate_up_proj = new_parameter((held, 2 * local, hidden), torch.int8, device, moe.weight_loader)
    moe.down_proj = new_parameter((held, hidden, local), torch.int8, device, moe.weight_loader)
    moe.gate_up_proj_scale = new_parameter((held, 2 * local), torch.float32, device, moe.weight_loader)
    moe.down_proj_scale = new_parameter((held, hidden), torch.float32, device, moe.weight_loader)


def set_scale_shards(moe: Any, num_local_experts: int) -> None:
    """The scales' shard ids are the weights'; all of them are computed here (none is read from the checkpoint).

    Another rank's experts (expert parallelism) are never quantized on this rank, so their
    ids are marked computed up front.
    """
    for scale, weight in ((moe.gate_up_proj_scale, moe.gate_up_proj), (moe.down_proj_scale, moe.down_proj)):
        scale.shard_ids = weight.shard_ids
        held = range(moe.first_expert, moe.first_expert + num_local_experts)
        scale.computed_shard_ids = {s for s in weight.shard_ids if s[0] not in held}


def load_int8_expert(moe: Any, param: nn.Parameter, source: CheckpointSource, shard_id: tuple[int, str],
                     slot: int, start: int, local: int) -> None:
    """Quantize expert ``shard_id = (e, kind)``'s float tensor into slot ``slot`` of ``param`` (and its scales).

    Args:
        moe: the :class:`~worker.layers.moe.FusedMoE` (``hidden_size``, ``intermediate_size``, the scales).
        param: ``moe.gate_up_proj`` or ``moe.down_proj`` (int8).
        source: the checkpoint tensor, ``(I_full, H)`` for gate/up, ``(H, I_full)`` for down
            (shape-checked by the caller).
        slot: the expert's index in this rank's stack.
        start, local: this rank's range of the intermediate dimension.

    Raises:
        ValueError: the checkpoint stores the expert as int8 (not supported: served from float only).
    """
    kind = shard_id[1]
    if kind == "down":
        columns = read_narrow(source, 1, start, local)  # (H, local)
        _refuse_stored_int8(columns)
        whole = local == moe.intermediate_size  # whole rows read: their scales come from them
        q, scales = quantize_rows(columns, None if whole else row_scales(source))  # (H, local), (H,)
        copy_into(moe.down_proj_scale.data[slot], scales)
        copy_into(param.data[slot], q)
        moe.down_proj_scale.computed_shard_ids.add(shard_id)
        return
    rows = read_narrow(source, 0, start, local)  # (local, H)
    _refuse_stored_int8(rows)
    offset = 0 if kind == "gate" else local
    q, scales = quantize_rows(rows)  # (local, H), (local,)
    copy_into(moe.gate_up_proj_scale.data[slot, offset:offset + local], scales)
    copy_into(param.data[slot, offset:offset + local], q)
    moe.gate_up_proj_scale.computed_shard_ids.add(shard_id)


def _refuse_stored_int8(values: torch.Tensor) -> None:
    if values.dtype == torch.int8:
        raise ValueError("int8 expert weights stored in the checkpoint are not supported; serve the float (or FP8) "
                         "checkpoint with --quantization int8")


def dequantize_experts(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q (E, N, K) int8``, ``scales (E, N) float32`` -> ``q * scales[..., None]`` ``(E, N, K)`` in ``dtype``.

    Computed in float32 and rounded once to ``dtype``.
    """
    return (q.float() * scales[..., None]).to(dtype)  # (E, N, K)


def check_loadable(moe: nn.Module, bias: bool, quantization: str = "int8") -> None:
    """Refuse quantized (int8 or int4) experts where this module cannot fill them (one line each).

    Raises:
        ValueError: experts with biases (gpt-oss's stacked layout) or a subclass with its own
            checkpoint layout (Llama 4): their loaders fill float parameters only.
    """
    if bias or not getattr(moe, "loads_int8", False):
        layout = getattr(moe, "checkpoint_layout", "experts with biases")
        raise ValueError(f"--quantization {quantization} is not supported for mixture-of-experts models whose "
                         f"experts are {layout} (a checkpoint layout that --quantization does not requantize); serve "
                         "them without the flag (gpt-oss's MXFP4 experts are then held as 8-bit codes on CPU ranks)")
