"""Experts stored stacked, transposed and gate/up-interleaved, with biases: gpt-oss's checkpoint layout.

``transformers``' ``GptOssExperts`` (``modeling_gpt_oss.py``) keeps every expert of a layer
in four tensors, which its checkpoints store as they are:

    gate_up_proj       (E, H, 2 * I)   x @ gate_up_proj[e]: column 2j is gate unit j, column 2j + 1 up unit j
    gate_up_proj_bias  (E, 2 * I)      interleaved likewise
    down_proj          (E, I, H)       h @ down_proj[e]
    down_proj_bias     (E, H)

:class:`FusedMoE` holds ``gate_up_proj (E, 2 * I / tp, H)`` as ``[gate | up]`` rows and
``down_proj (E, H, I / tp)`` (``F.linear``'s ``(out, in)``). Rank ``r`` of ``tp`` owns units
``[r * I / tp, (r + 1) * I / tp)`` of every expert, which are the *contiguous* columns
``[2 r I / tp, 2 (r + 1) I / tp)`` of the interleaved tensor: each rank reads only those,
one expert at a time (no rank holds a whole layer's experts), splits even and odd columns
into gate and up, and transposes. The down bias is added after the down projection, whose
output is a partial of the sum over ranks: rank 0 holds it, the other ranks zeros, so
the all-reduce adds it once (as vLLM's gpt-oss does). MXFP4 experts on a CPU rank are held as exact 8-bit
codes with a scale per 32 instead of float (worker/layers/moe_mxfp4.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tpserve.quantization import Quantization
from worker.dequantize import Mxfp4Source
from worker.layers.moe import FusedMoE
from worker.layers.moe_mxfp4 import load as load_mxfp4_codes
from worker.layers.moe_mxfp4 import mxfp4_codes_apply
from worker.layers.weights import CheckpointSource, check_shape, copy_into
from worker.parallel_state import ParallelContext


class StackedFusedMoE(FusedMoE):
    """:class:`FusedMoE` with biases, filled from the stacked layout above (one checkpoint tensor per parameter).

    Args: those of :class:`FusedMoE` (``bias`` is always on).

    Raises:
        ValueError: from the loader, a checkpoint tensor of another shape (named by the loader).
    """

    loads_int8 = False  # the fused layout is filled into float stacks only
    checkpoint_layout = "gpt-oss's stacked experts with biases"  # what a refusal names

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: ParallelContext, *,
                 dtype: torch.dtype, quantization: Quantization | None = None,
                 activation: nn.Module | None = None) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, ctx, dtype=dtype, quantization=quantization,
                         bias=True, activation=activation)
        for param in (self.gate_up_proj, self.down_proj):
            param.shard_ids = (None,)  # type: ignore[attr-defined]  # one stacked checkpoint tensor each

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Fill one of the four parameters from its stacked checkpoint tensor (this rank's units)."""
        num_experts, hidden, full = self.num_experts, self.hidden_size, self.intermediate_size
        local = self.intermediate_size_per_partition
        start = self.ctx.tp_rank * local
        if (param is self.gate_up_proj or param is self.down_proj) and mxfp4_codes_apply(self, source):
            check_shape(source, (num_experts, hidden, 2 * full) if param is self.gate_up_proj else
                        (num_experts, full, hidden))
            load_mxfp4_codes(self, param, cast(Mxfp4Source, source))  # exact 8-bit codes (moe_mxfp4.py)
        elif param is self.gate_up_proj:
            check_shape(source, (num_experts, hidden, 2 * full))
            for e in range(num_experts):  # one expert at a time: (1, H, 2 * local) read
                pairs = source[e:e + 1, :, 2 * start:2 * (start + local)][0]  # (H, 2 * local) interleaved
                copy_into(param.data[e], torch.cat([pairs[:, 0::2], pairs[:, 1::2]], dim=1).t())  # (2 * local, H)
        elif param is self.gate_up_proj_bias:
            check_shape(source, (num_experts, 2 * full))
            pairs = source[:, 2 * start:2 * (start + local)]  # (E, 2 * local) interleaved
            copy_into(param.data, torch.cat([pairs[:, 0::2], pairs[:, 1::2]], dim=1))  # (E, 2 * local) [gate | up]
        elif param is self.down_proj:
            check_shape(source, (num_experts, full, hidden))
            for e in range(num_experts):
                copy_into(param.data[e], source[e:e + 1, start:start + local, :][0].t())  # (H, local)
        elif param is self.down_proj_bias:
            check_shape(source, (num_experts, hidden))
            if self.ctx.tp_rank == 0:  # once in the sum over ranks
                copy_into(param.data, source[:, :])
            else:
                param.data.zero_()
        else:
            raise ValueError("not a parameter of these experts")
