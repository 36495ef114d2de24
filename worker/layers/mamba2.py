"""The Mamba-2 mixer (Granite 4 hybrid, Nemotron-H), one tensor-parallel shard of it: a state layer.

Architecture (Dao & Gu 2024, arXiv:2405.21060; reference: ``transformers``' ``modeling_mamba2.py``,
``Mamba2Mixer``, whose layout ``GraniteMoeHybridMambaLayer`` and ``NemotronHMamba2Mixer`` share), for
the ``T`` rows of one step on one rank:

    z, xBC, dt = in_proj(u)                        column-parallel: this rank's heads' z, x, dt,
                                                   its groups' B, C (all groups when n_groups == 1)
    xBC = silu(causal_conv1d(xBC))                 depthwise, kernel K, carried window (the conv state)
    x, B, C = xBC                                  x (T, heads, head_dim), B, C (T, groups, d_state)
    dt = clamp(softplus(dt + dt_bias), *time_step_limit)
    y = ssd(x, dt, A = -exp(A_log), B, C, D)       worker/layers/ssd.py: chunked form for prefill rows,
                                                   recurrent step for the decode group (the SSM state)
    y = rms_norm_per_group(y * silu(z)) * weight   gated RMSNorm over each group's channels
    out = out_proj(y)                              row-parallel, all-reduce

Tensor parallelism (as vLLM's ``MambaMixer2``): heads split like attention heads, and with them
the channels of z, x, dt, ``dt_bias``, ``A_log``, ``D`` and the norm; the ``n_groups`` groups of B
and C are split when ``n_groups`` divides by ``tp_size`` (a rank's heads read only its groups) and
replicated on every rank when ``n_groups == 1``; anything else is refused. With one group split
over several ranks, the gated norm's mean of squares spans ranks: each rank sums its channels'
squares and one all-reduce adds them.

State (worker/state_metadata.py), per slot: the conv window ``(conv_dim, K - 1)`` over this rank's
x, B and C channels and the SSM state ``(heads, head_dim, d_state)``, both float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.causal_conv1d import causal_conv1d_decode, causal_conv1d_prefill
from worker.layers.linear import RowParallelLinear, divide
from worker.layers.matmul import linear
from worker.layers.ssd import ssd_chunked_scan, ssd_recurrent_step
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.parallel_state import ParallelContext
from worker.state_metadata import StateMetadata


@dataclass(frozen=True)
class Mamba2Spec:
    """A Mamba-2 mixer's sizes, under whatever names the family's config gives them.

    Attributes:
        hidden_size: the model's width.
        num_heads, head_dim: SSM heads and their width (``num_heads * head_dim`` is the inner width ``I``).
        n_groups: groups of B and C (``num_heads`` divides by it).
        d_state: ``N``, the state size per head channel.
        conv_kernel: ``K``.
        chunk_size: rows per chunk of the chunked scan.
        norm_eps: the gated RMSNorm's epsilon.
        time_step_limit: ``(min, max)`` the time step is clamped to.
        conv_bias, proj_bias: the convolution / in_proj and out_proj carry biases.
        heads_key, groups_key: the config keys of ``num_heads`` and ``n_groups`` (for error messages).
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    proj_bias: bool = False
    heads_key: str = "num_heads"
    groups_key: str = "n_groups"

    @property
    def intermediate_size(self) -> int:
        """``I = num_heads * head_dim``."""
        return self.num_heads * self.head_dim


def mamba2_time_step_limit(value: Any) -> tuple[float, float]:
    """``time_step_limit`` as config.json writes it: ``[min, max]`` numbers (``Infinity`` parsed by json),
    or ``transformers`` 5's ``{"__float__": "Infinity"}`` tag for a non-finite entry; None: no limit."""
    if value is None:
        return 0.0, math.inf
    tags = {"Infinity": math.inf, "-Infinity": -math.inf}
    low, high = (tags[v["__float__"]] if isinstance(v, dict) else float(v) for v in value)
    return low, high


def mamba2_group_share(n_groups: int, tp_size: int, groups_key: str) -> int:
    """B/C groups per rank: ``n_groups / tp_size``, or 1 (replicated) when ``n_groups == 1``.

    Raises:
        ValueError: ``n_groups`` neither 1 nor divisible by ``tp_size`` (one line naming the field).
    """
    if n_groups % tp_size == 0:
        return n_groups // tp_size
    if n_groups == 1:
        return 1
    raise ValueError(f"{groups_key}={n_groups} is not divisible by tensor_parallel_size={tp_size} "
                     "(Mamba-2's B/C groups are split across ranks, or replicated when there is one)")


def load_row_parts(param: nn.Parameter, source: CheckpointSource, total_rows: int,
                   parts: list[tuple[int, int]]) -> None:
    """Fill ``param``'s rows, in order, from the ``(first_row, num_rows)`` runs of a checkpoint tensor.

    Raises:
        ValueError: the checkpoint tensor is not ``(total_rows, *param.shape[1:])``.
    """
    check_shape(source, (total_rows, *param.shape[1:]))
    offset = 0
    for first, num_rows in parts:
        copy_into(param.data[offset:offset + num_rows], read_narrow(source, 0, first, num_rows))
        offset += num_rows


class _RowParts(nn.Module):
    """A parameter holder (``weight``, optional ``bias``) whose rows are runs of the checkpoint tensor's."""

    def __init__(self, shape: tuple[int, ...], total_rows: int, parts: list[tuple[int, int]], ctx: ParallelContext,
                 dtype: torch.dtype, *, bias: bool) -> None:
        super().__init__()
        self.total_rows, self.parts = total_rows, parts
        self.weight = new_parameter(shape, dtype, ctx.device, self.weight_loader)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = new_parameter(shape[:1], dtype, ctx.device, self.weight_loader)
            self.bias.shard_ids = (None,)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        load_row_parts(param, source, self.total_rows, self.parts)


class Mamba2Mixer(nn.Module):
    """This rank's share of one Mamba-2 mixer; a :class:`worker.state_metadata.StateLayer`.

    Args:
        spec: the sizes.
        ctx: the tensor-parallel group.
        dtype: parameter and activation dtype (the states are float32).

    Shapes: ``forward(u (T, hidden_size), state, meta) -> (T, hidden_size)`` in ``u.dtype``,
    all-reduced over ranks. ``state = (conv_states (slots, conv_dim, K - 1), ssm_states (slots,
    num_heads, head_dim, d_state))``, float32, this rank's channels and heads.

    Checkpoint names under the mixer: ``in_proj.weight`` (rows z, x, B, C, dt), ``conv1d.weight``
    ``(conv_dim, 1, K)`` and ``conv1d.bias`` (rows x, B, C), ``dt_bias``, ``A_log``, ``D``,
    ``norm.weight``, ``out_proj.weight`` (and the projections' biases with ``proj_bias``).

    Raises:
        ValueError: heads or groups that do not split over ``tp_size``, or heads not a multiple of groups.
    """

    def __init__(self, spec: Mamba2Spec, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        tp, rank = ctx.tp_size, ctx.tp_rank
        if spec.num_heads % spec.n_groups:
            raise ValueError(f"{spec.heads_key}={spec.num_heads} is not a multiple of {spec.groups_key}={spec.n_groups}")
        self.spec, self.ctx = spec, ctx
        self.num_heads = divide(spec.num_heads, tp, spec.heads_key)
        self.num_groups = mamba2_group_share(spec.n_groups, tp, spec.groups_key)
        self.head_dim, self.d_state = spec.head_dim, spec.d_state
        inner, bc = spec.intermediate_size, spec.n_groups * spec.d_state  # full widths of x (and z), of B (and C)
        self.inner_size = self.num_heads * spec.head_dim  # this rank's x / z channels
        self.bc_size = self.num_groups * spec.d_state  # this rank's B / C channels
        self.conv_dim = self.inner_size + 2 * self.bc_size
        heads_first = rank * self.inner_size  # this rank's first channel of an I-wide block (z, x)
        bc_first = rank * self.bc_size if self.num_groups < spec.n_groups else 0  # replicated: all of them
        # (first row, rows) of the checkpoint's in_proj blocks z (I), x (I), B (G N), C (G N), dt (H)
        # and of the conv's x, B, C that this rank holds, in that order.
        in_parts = [(heads_first, self.inner_size), (inner + heads_first, self.inner_size),
                    (2 * inner + bc_first, self.bc_size), (2 * inner + bc + bc_first, self.bc_size),
                    (2 * inner + 2 * bc + rank * self.num_heads, self.num_heads)]
        conv_parts = [(heads_first, self.inner_size), (inner + bc_first, self.bc_size),
                      (inner + bc + bc_first, self.bc_size)]
        in_rows = 2 * self.inner_size + 2 * self.bc_size + self.num_heads
        self.in_proj = _RowParts((in_rows, spec.hidden_size), 2 * inner + 2 * bc + spec.num_heads, in_parts, ctx,
                                 dtype, bias=spec.proj_bias)
        self.conv1d = _RowParts((self.conv_dim, 1, spec.conv_kernel), inner + 2 * bc, conv_parts, ctx, dtype,
                                bias=spec.conv_bias)
        head_rows = [(rank * self.num_heads, self.num_heads)]
        self.dt_bias = _head_parameter(self.num_heads, spec.num_heads, head_rows, ctx, dtype)
        self.A_log = _head_parameter(self.num_heads, spec.num_heads, head_rows, ctx, dtype)
        self.D = _head_parameter(self.num_heads, spec.num_heads, head_rows, ctx, dtype)
        self.norm = GatedGroupRMSNorm(self.inner_size, inner, spec.intermediate_size // spec.n_groups, spec.norm_eps,
                                      ctx, dtype)
        self.out_proj = RowParallelLinear(inner, spec.hidden_size, ctx, bias=spec.proj_bias, dtype=dtype)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per slot: the conv window ``(conv_dim, K - 1)`` and the SSM state ``(heads, head_dim, d_state)``."""
        return (self.conv_dim, self.spec.conv_kernel - 1), (self.num_heads, self.head_dim, self.d_state)

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        """Both states float32, whatever the activations (as vLLM's ``mamba_ssm_cache_dtype`` default)."""
        return torch.float32, torch.float32

    def forward(self, u: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        conv_states, ssm_states = state
        proj = linear(u, self.in_proj.weight, self.in_proj.bias)  # (T, 2 I_r + 2 G_r N + H_r)
        z, xbc, dt = proj.split([self.inner_size, self.conv_dim, self.num_heads], dim=-1)
        low, high = self.spec.time_step_limit
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(low, high)  # (T, H_r) float32
        A = -torch.exp(self.A_log.float())  # (H_r,)
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias  # (conv_dim, K), (conv_dim,)
        y = torch.empty(u.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=u.device)
        num_decodes = meta.num_decodes
        if num_decodes:
            slots = meta.slots[:num_decodes]
            xbc_d = causal_conv1d_decode(xbc[:num_decodes], weight, bias, conv_states, slots, "silu")  # (S, conv_dim)
            x, B, C = self._split_xbc(xbc_d)
            y[:num_decodes] = ssd_recurrent_step(x, dt[:num_decodes], A, B, C, self.D, ssm_states, slots)
        slot_ids = meta.host_slots or tuple(meta.slots.tolist())  # Python ints: no device read when given
        for index in range(num_decodes, meta.num_seqs):
            slot = slot_ids[index]
            for start, end, save in meta.segments(index):
                xbc_p = causal_conv1d_prefill(xbc[start:end], weight, bias, conv_states[slot], "silu")  # (L, conv_dim)
                x, B, C = self._split_xbc(xbc_p)
                y[start:end], final = ssd_chunked_scan(x, dt[start:end], A, B, C, self.D, ssm_states[slot],
                                                       self.spec.chunk_size)
                ssm_states[slot].copy_(final)
                if save is not None:  # a prompt block boundary: keep this state for prefix caching
                    conv_states[save].copy_(conv_states[slot])
                    ssm_states[save].copy_(ssm_states[slot])
        gated = self.norm(y.view(u.shape[0], self.inner_size), z)  # (T, I_r) in u.dtype
        return self.out_proj(gated)  # (T, hidden), all-reduced over ranks

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(L, conv_dim)`` -> ``x (L, H_r, P)``, ``B, C (L, G_r, N)``."""
        x, B, C = xbc.split([self.inner_size, self.bc_size, self.bc_size], dim=-1)
        rows = xbc.shape[0]
        return (x.reshape(rows, self.num_heads, self.head_dim), B.reshape(rows, self.num_groups, self.d_state),
                C.reshape(rows, self.num_groups, self.d_state))


def _head_parameter(num_local: int, total: int, parts: list[tuple[int, int]], ctx: ParallelContext,
                    dtype: torch.dtype) -> nn.Parameter:
    """A per-head vector (``dt_bias``, ``A_log``, ``D``): this rank's heads' entries."""
    param = new_parameter((num_local,), dtype, ctx.device, lambda p, source, shard_id=None: load_row_parts(
        p, source, total, parts))
    param.shard_ids = (None,)  # type: ignore[attr-defined]
    return param


class GatedGroupRMSNorm(nn.Module):
    """``rms_norm_per_group(y * silu(z)) * weight``, Mamba-2's output norm (``norm_before_gate=False``).

    As ``transformers``' ``MambaRMSNormGated`` / ``GraniteMoeHybridRMSNormGated``: the gate is
    applied first, in float32, then each group of ``group_size`` channels is divided by its root
    mean square (plus ``eps``), cast back to the activations' dtype and scaled by ``weight``.

    Args:
        local_size: this rank's channels (whole groups, or a slice of the one group).
        total_size: the full width ``I``.
        group_size: channels per group, ``I / n_groups``.
        eps: the epsilon.
        ctx, dtype: the tensor-parallel group and the weight's dtype.

    A rank holding a slice of one group (``n_groups == 1``, ``tp > 1``) sums its squares and
    all-reduces them, so the mean is over the whole group. Shapes: ``y, z (T, local_size)`` ->
    ``(T, local_size)`` in ``z``'s dtype (the activations').
    """

    def __init__(self, local_size: int, total_size: int, group_size: int, eps: float, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx, self.eps, self.group_size = ctx, eps, group_size
        self.spans_ranks = local_size < group_size
        self.weight = new_parameter((local_size,), dtype, ctx.device, lambda p, source, shard_id=None: load_row_parts(
            p, source, total_size, [(ctx.tp_rank * local_size, local_size)]))
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        rows, width = y.shape
        g = y.float() * F.silu(z.float())  # (T, I_r) float32
        if self.spans_ranks:
            squares = self.ctx.all_reduce(g.pow(2).sum(-1, keepdim=True))  # (T, 1), the whole group's
            normed = g * torch.rsqrt(squares / self.group_size + self.eps)
        else:
            groups = g.view(rows, width // self.group_size, self.group_size)  # (T, G_r, I / G)
            normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view(rows, width)
        return self.weight * normed.to(z.dtype)  # (T, I_r)
