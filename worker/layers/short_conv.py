"""LFM2's gated short convolution: a state layer whose state is a depthwise convolution's window.

Reference: ``transformers``' ``modeling_lfm2.py`` (``Lfm2ShortConv``). For rows ``x (T, hidden)``:

    B, C, u = in_proj(x)                    three (T, hidden) blocks, column-parallel by channel
    v = B * u                               input gate
    w = conv(v)                             depthwise causal conv over time, kernel L = conv_L_cache,
                                            no activation; its last L - 1 inputs are the state
    y = out_proj(C * w)                     output gate, row-parallel, all-reduce

Every channel is independent until ``out_proj``, so tensor parallelism splits the channels: rank
``r`` holds rows ``[r * hidden / tp, (r + 1) * hidden / tp)`` of each of ``in_proj``'s three blocks
and of the convolution's taps, and its slice of the state (``(hidden / tp, L - 1)`` per sequence).
The state continues across prefill chunks and decode steps (worker/layers/causal_conv1d.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.quantization import Quantization
from worker.layers.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.parallel_state import ParallelContext
from worker.state_metadata import StateMetadata


class DepthwiseConvWeights(nn.Module):
    """A depthwise ``nn.Conv1d``'s parameters, this rank's channels: ``weight (C / tp, 1, L)``, ``bias (C / tp,)``.

    The checkpoint's ``conv.weight (C, 1, L)`` and ``conv.bias (C,)`` are read for rows
    ``[tp_rank * C / tp, (tp_rank + 1) * C / tp)`` only.
    """

    def __init__(self, channels: int, kernel_size: int, ctx: ParallelContext, *, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if channels % ctx.tp_size:
            raise ValueError(f"hidden_size={channels} is not divisible by tensor_parallel_size={ctx.tp_size}")
        self.channels, self.kernel_size = channels, kernel_size
        self.num_local = channels // ctx.tp_size
        self.first = ctx.tp_rank * self.num_local
        self.weight = new_parameter((self.num_local, 1, kernel_size), dtype, ctx.device, self.weight_loader)
        self.bias = new_parameter((self.num_local,), dtype, ctx.device, self.weight_loader) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_ids = (None,)  # type: ignore[attr-defined]  # one checkpoint tensor each

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's channels of the checkpoint's weight or bias into ``param``."""
        check_shape(source, (self.channels, *param.shape[1:]))
        copy_into(param.data, read_narrow(source, 0, self.first, self.num_local))


class ShortConv(nn.Module):
    """The gated short convolution of one LFM2 layer (module docstring), a :class:`~worker.state_metadata.StateLayer`.

    Args:
        hidden_size: width of the residual stream (the convolution's channels).
        kernel_size: ``conv_L_cache``, taps of the convolution (>= 2).
        ctx: the tensor-parallel group.
        bias: ``conv_bias``: biases on in_proj, the convolution and out_proj.
        dtype: parameter and activation dtype (the state is kept in it too).
        quantization: None, "int8" or "int4" for in_proj and out_proj.

    Checkpoint names under the layer's ``conv.``: ``in_proj`` (fused B, C, x rows), ``conv``
    (the depthwise taps), ``out_proj``.
    """

    def __init__(self, hidden_size: int, kernel_size: int, ctx: ParallelContext, *, bias: bool, dtype: torch.dtype,
                 quantization: Quantization | None = None) -> None:
        super().__init__()
        self.in_proj = MergedColumnParallelLinear(hidden_size, [hidden_size] * 3, ctx, bias=bias, dtype=dtype,
                                                  quantization=quantization)
        self.conv = DepthwiseConvWeights(hidden_size, kernel_size, ctx, bias=bias, dtype=dtype)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, ctx, bias=bias, dtype=dtype,
                                          quantization=quantization)
        self.num_channels = self.conv.num_local
        self.dtype = dtype

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One tensor per slot: the last ``L - 1`` inputs of this rank's channels, ``(hidden / tp, L - 1)``."""
        return ((self.num_channels, self.conv.kernel_size - 1),)

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        """The window holds inputs as the activations are: ``dtype``."""
        return (self.dtype,)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``, all-reduced; updates each sequence's window in ``state[0]``
        (``(num_slots, hidden / tp, L - 1)``) and saves the window after the rows ``meta.checkpoints`` name
        into their checkpoint slots."""
        c = self.num_channels
        b, gate, u = self.in_proj(x).split(c, dim=1)  # each (T, hidden / tp)
        v = b * u  # (T, hidden / tp)
        windows = state[0]
        weight, bias = self.conv.weight.squeeze(1), self.conv.bias  # (hidden / tp, L), (hidden / tp,)
        d = meta.num_decodes
        w = torch.empty_like(v)
        if d:  # one row per sequence: the recurrent step over the slots at once
            w[:d] = causal_conv1d_decode(v[:d], weight, bias, windows, meta.slots[:d])
        keep = self.conv.kernel_size - 1
        for i in range(d, meta.num_seqs):  # chunks: each sequence's rows in one convolution
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            window = windows[meta.host_slots[i]]  # (hidden / tp, L - 1), a view updated in place
            marks = meta.checkpoints[i] if i < len(meta.checkpoints) else ()
            # The state after r rows is the last L - 1 inputs up to them: columns [r, r + L - 1) of the
            # window followed by the rows, so checkpoints need no split of the chunk.
            if marks:
                inputs = torch.cat([window, v[start:end].t().to(window.dtype)], dim=1)  # (hidden / tp, L - 1 + rows)
                for rows, slot in marks:
                    windows[slot].copy_(inputs[:, rows:rows + keep])
            w[start:end] = causal_conv1d_prefill(v[start:end], weight, bias, window)
        return self.out_proj(gate * w)  # (T, hidden), all-reduced over ranks
