"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5, on this rank's heads.

Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks" (arXiv:2412.06464); reference: ``transformers``'
``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``. For the rows ``x (T, hidden)`` of a step, per sequence:

    q, k, v, z, b, a = in_proj(x)                        column-parallel, by key head (the layouts below)
    q, k, v = silu(causal_conv1d([q, k, v]))             depthwise, kernel K, window carried (the conv state)
    q, k = l2norm(q), l2norm(k); q = q / sqrt(d_k)       each key head; a key head serves num_v / num_k value heads
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)        per value head
    o = gated_delta_rule(q, k, v, g, beta, S)            S (num_v, d_k, d_v): the recurrent state
    y = out_proj(rms_norm(o) * silu(z))                  per value head; row-parallel, all-reduce

Tensor parallelism splits the key heads (``linear_num_key_heads / tp`` per rank) and with each its value
heads, so a rank's heads never read another rank's: its conv channels (its q, k and v slices), its
``A_log``/``dt_bias`` entries and its states follow; only ``out_proj`` all-reduces. Per state slot a rank
holds ``conv (2 * key_dim + value_dim) / tp, K - 1)`` and ``recurrent (num_v / tp, d_k, d_v)``, both float32
(worker/state_metadata.py's pool; the runner zeroes a slot before a sequence's first chunk).

Prefill chunks run :func:`~worker.layers.gated_delta_rule.chunked` per sequence, split at the step's
checkpoints (the state is copied into the checkpoint slot after each); the decode group runs
:func:`~worker.layers.gated_delta_rule.recurrent_step` once for all its sequences, its states gathered from
and scattered back to the pool.

Checkpoint layouts of the input projection (``H = hidden``, ``r = num_v / num_k``):

* Qwen3-Next (:class:`GroupedProjectionGatedDeltaNet`): ``in_proj_qkvz (num_k * (2 d_k + 2 r d_v), H)``
  grouped by key head, each group ``[q (d_k), k (d_k), v (r d_v), z (r d_v)]``, and ``in_proj_ba
  (num_k * 2r, H)``, each group ``[b (r), a (r)]``; grouped by key head, a rank's rows are one contiguous
  block of each;
* Qwen3.5 (:class:`SeparateProjectionGatedDeltaNet`): ``in_proj_qkv`` rows ``[q (num_k d_k), k (num_k d_k),
  v (num_v d_v)]``, ``in_proj_z (num_v d_v, H)``, ``in_proj_b``, ``in_proj_a (num_v, H)``.

Both feed the convolution the channels ``[q, k, v]``, as the checkpoint's ``conv1d.weight (C, 1, K)`` orders them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from worker.layers.gated_delta_rule import CHUNK_SIZE, chunked, recurrent_step
from worker.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, divide
from worker.layers.norm import GatedRMSNorm
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.parallel_state import ParallelContext
from worker.state_metadata import StateMetadata

#: The epsilon of the L2 normalisation of q and k (flash-linear-attention's and the reference's ``l2norm``).
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class GatedDeltaNetSizes:
    """The model-wide sizes of a Gated DeltaNet layer (``config.json``'s ``linear_*`` keys, ``transformers``' defaults)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    @classmethod
    def from_config(cls, config: ModelConfig) -> GatedDeltaNetSizes:
        """Read them from ``config`` (a bad type raises ``ValueError`` naming the key)."""
        return cls(config.hidden_size, config.hf_value("linear_num_key_heads", 16),
                   config.hf_value("linear_num_value_heads", 32), config.hf_value("linear_key_head_dim", 128),
                   config.hf_value("linear_value_head_dim", 128), config.hf_value("linear_conv_kernel_dim", 4),
                   config.rms_norm_eps)


class GatedDeltaNet(nn.Module):
    """The mixer on this rank's heads; a subclass holds the checkpoint's input projections (:meth:`project`).

    Args:
        sizes: the layer's model-wide sizes.
        ctx: the tensor-parallel group.
        dtype: parameter and activation dtype.
        quantization: passed to the input and output projections.

    Raises:
        ValueError: ``linear_num_key_heads`` or ``linear_num_value_heads`` not divisible by
            ``tensor_parallel_size``, or value heads not a multiple of key heads (each message names the field).

    Implements :class:`worker.state_metadata.StateLayer`: ``forward(x (T, hidden), state, meta) -> (T, hidden)``.
    """

    #: Rows per chunk of the prefill form (tests shorten it to put chunk edges inside short prompts).
    chunk_size = CHUNK_SIZE

    def __init__(self, sizes: GatedDeltaNetSizes, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None = None) -> None:
        super().__init__()
        if sizes.num_v_heads % sizes.num_k_heads:
            raise ValueError(f"linear_num_value_heads={sizes.num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={sizes.num_k_heads}")
        self.sizes, self.ctx = sizes, ctx
        self.num_k_heads = divide(sizes.num_k_heads, ctx.tp_size, "linear_num_key_heads")  # this rank's
        self.num_v_heads = divide(sizes.num_v_heads, ctx.tp_size, "linear_num_value_heads")
        self.key_dim = self.num_k_heads * sizes.head_k_dim  # this rank's q (and k) channels
        self.value_dim = self.num_v_heads * sizes.head_v_dim
        self.conv1d = HeadShardedConv1d([sizes.num_k_heads * sizes.head_k_dim] * 2
                                        + [sizes.num_v_heads * sizes.head_v_dim], sizes.conv_kernel, ctx, dtype)
        self.dt_bias = new_parameter((self.num_v_heads,), dtype, ctx.device, self._load_value_heads)
        self.A_log = new_parameter((self.num_v_heads,), dtype, ctx.device, self._load_value_heads)
        for param in (self.dt_bias, self.A_log):
            param.shard_ids = (None,)  # type: ignore[attr-defined]
        self.norm = GatedRMSNorm(sizes.head_v_dim, sizes.eps, dtype=dtype, device=ctx.device)
        self.out_proj = RowParallelLinear(sizes.num_v_heads * sizes.head_v_dim, sizes.hidden_size, ctx, bias=False,
                                          dtype=dtype, quantization=quantization)

    def _load_value_heads(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """``dt_bias`` / ``A_log`` ``(num_v_heads,)``: this rank's value heads only."""
        check_shape(source, (self.sizes.num_v_heads,))
        copy_into(param.data, read_narrow(source, 0, self.ctx.tp_rank * self.num_v_heads, self.num_v_heads))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x (T, hidden)`` -> ``qkv (T, 2 * key_dim + value_dim)`` as ``[q | k | v]`` (this rank's channels),
        ``z (T, num_v_heads, head_v_dim)``, ``b, a (T, num_v_heads)``."""
        raise NotImplementedError

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((conv channels, K - 1), (num_v_heads, head_k_dim, head_v_dim))`` on this rank."""
        s = self.sizes
        return ((2 * self.key_dim + self.value_dim, s.conv_kernel - 1), (self.num_v_heads, s.head_k_dim, s.head_v_dim))

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        """Both states float32, whatever the activations."""
        return (torch.float32, torch.float32)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """``x (T, hidden)`` (normed) -> ``(T, hidden)``, all-reduced; updates ``state`` at the step's slots."""
        conv_states, recurrent_states = state
        num_tokens = x.shape[0]
        qkv, z, b, a = self.project(x)  # (T, C), (T, Hv, d_v), (T, Hv), (T, Hv)
        qkv = self._convolve(qkv, conv_states, meta)  # (T, C), silu applied
        q, k, v = self._heads(qkv)  # float32 (T, Hv, d_k), (T, Hv, d_k), (T, Hv, d_v)
        beta = b.sigmoid().float()  # (T, Hv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (T, Hv) log-decay, <= 0
        o = self._delta_rule(q, k, v, g, beta, recurrent_states, meta)  # (T, Hv, d_v) float32
        o = self.norm(o.to(x.dtype), z)  # (T, Hv, d_v)
        return self.out_proj(o.reshape(num_tokens, self.value_dim))  # (T, hidden), all-reduced over ranks

    def _convolve(self, qkv: torch.Tensor, conv_states: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """The causal conv + SiLU over every row, each sequence continuing from its slot's window."""
        out = torch.empty_like(qkv)  # (T, C)
        weight, n = self.conv1d.weight, meta.num_decodes
        if n:
            out[:n] = causal_conv1d_decode(qkv[:n], weight, None, conv_states, meta.slots[:n], "silu")
        slots = meta.host_slots
        for i in range(n, meta.num_seqs):
            for start, end, save in meta.segments(i):
                out[start:end] = causal_conv1d_prefill(qkv[start:end], weight, None, conv_states[slots[i]], "silu")
                if save is not None:
                    conv_states[save].copy_(conv_states[slots[i]])
        return out

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[q | k | v] (T, C)`` -> float32 ``q`` (L2-normalised, scaled by ``d_k ** -0.5``), ``k`` (L2-normalised),
        both repeated onto the value heads each key head serves, and ``v``."""
        s, t = self.sizes, qkv.shape[0]
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=1)
        q = q.reshape(t, self.num_k_heads, s.head_k_dim)  # (T, Hk, d_k)
        k = k.reshape(t, self.num_k_heads, s.head_k_dim)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2NORM_EPS) * s.head_k_dim ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
        groups = self.num_v_heads // self.num_k_heads  # value heads per key head, consecutive
        return (q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1),
                v.reshape(t, self.num_v_heads, s.head_v_dim))

    def _delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """The gated delta rule over every row: the decode group in one recurrent step, each prefill chunked."""
        out = torch.empty_like(v)  # (T, Hv, d_v) float32
        n = meta.num_decodes
        if n:
            slots = meta.slots[:n]
            out[:n], new = recurrent_step(q[:n], k[:n], v[:n], g[:n], beta[:n], states.index_select(0, slots))
            states.index_copy_(0, slots, new)  # (a decode-group sequence has no checkpoint)
        slot_ids = meta.host_slots
        for i in range(n, meta.num_seqs):
            live = states[slot_ids[i]]  # (Hv, d_k, d_v), a view into the pool
            for start, end, save in meta.segments(i):
                rows = slice(start, end)
                out[rows], new = chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], live, self.chunk_size)
                live.copy_(new)
                if save is not None:
                    states[save].copy_(live)
        return out


class HeadShardedConv1d(nn.Module):
    """The depthwise conv's taps for this rank's channels of each part (q, k, v), ``weight (C_local, K)``.

    The checkpoint's ``conv1d.weight (sum(part_sizes), 1, K)`` stacks the parts; rank ``r`` reads rows
    ``[r * size / tp, (r + 1) * size / tp)`` of each part, in the order of :meth:`GatedDeltaNet.project`'s channels.
    """

    def __init__(self, part_sizes: list[int], kernel: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.part_sizes, self.kernel, self.ctx = part_sizes, kernel, ctx
        local = sum(divide(size, ctx.tp_size, "conv channels") for size in part_sizes)
        self.weight = new_parameter((local, kernel), dtype, ctx.device, self.weight_loader)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        check_shape(source, (sum(self.part_sizes), 1, self.kernel))
        first, offset = 0, 0
        for size in self.part_sizes:
            share = size // self.ctx.tp_size
            rows = read_narrow(source, 0, first + self.ctx.tp_rank * share, share)  # (share, 1, K)
            copy_into(param.data[offset:offset + share], rows.reshape(share, self.kernel))
            first, offset = first + size, offset + share


class GroupedProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections, grouped by key head: ``in_proj_qkvz`` and ``in_proj_ba`` (module docstring)."""

    def __init__(self, sizes: GatedDeltaNetSizes, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None = None) -> None:
        super().__init__(sizes, ctx, dtype, quantization)
        s = sizes
        self.in_proj_qkvz = ColumnParallelLinear(s.hidden_size, 2 * s.num_k_heads * s.head_k_dim
                                                 + 2 * s.num_v_heads * s.head_v_dim, ctx, bias=False, dtype=dtype,
                                                 quantization=quantization)
        self.in_proj_ba = ColumnParallelLinear(s.hidden_size, 2 * s.num_v_heads, ctx, bias=False, dtype=dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        s, t, hk = self.sizes, x.shape[0], self.num_k_heads
        r = self.num_v_heads // hk
        qkvz = self.in_proj_qkvz(x).view(t, hk, -1)  # (T, Hk, 2 d_k + 2 r d_v), grouped by key head
        q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, r * s.head_v_dim, r * s.head_v_dim], dim=2)
        b, a = self.in_proj_ba(x).view(t, hk, 2 * r).split([r, r], dim=2)  # (T, Hk, r) each
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)  # (T, C) as [q | k | v]
        return (qkv, z.reshape(t, self.num_v_heads, s.head_v_dim), b.reshape(t, self.num_v_heads),
                a.reshape(t, self.num_v_heads))


class SeparateProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's projections: ``in_proj_qkv`` (q, k, v stacked), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    def __init__(self, sizes: GatedDeltaNetSizes, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None = None) -> None:
        super().__init__(sizes, ctx, dtype, quantization)
        s = sizes
        key_dim, value_dim = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim
        self.in_proj_qkv = MergedColumnParallelLinear(s.hidden_size, [key_dim, key_dim, value_dim], ctx, bias=False,
                                                      dtype=dtype, quantization=quantization)
        self.in_proj_z = ColumnParallelLinear(s.hidden_size, value_dim, ctx, bias=False, dtype=dtype,
                                              quantization=quantization)
        self.in_proj_b = ColumnParallelLinear(s.hidden_size, s.num_v_heads, ctx, bias=False, dtype=dtype)
        self.in_proj_a = ColumnParallelLinear(s.hidden_size, s.num_v_heads, ctx, bias=False, dtype=dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.sizes.head_v_dim)  # (T, Hv, d_v)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)  # (T, C), z, (T, Hv), (T, Hv)
