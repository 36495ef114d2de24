"""Full-width QK-norm: one RMSNorm over all heads' queries together (and one over all keys), split by heads.

MiniMax-M2 (``transformers``' ``modeling_minimax_m2.py``) normalises the whole query
projection ``q (T, H * d)`` and the whole key projection ``k (T, KVH * d)`` before the
heads are split, unlike Qwen3's per-head norm (over ``d``):

    q = w_q * q / sqrt(mean(q ** 2 over all H * d) + eps)         statistics in float32, as LlamaRMSNorm
    k = w_k * k / sqrt(mean(k ** 2 over all KVH * d) + eps)

Tensor parallelism: rank ``r`` holds only its heads' columns, so the mean needs every
rank's sum of squares. Each rank sums its own (float32), the two sums of every token
travel in ONE all-reduce of ``(T, 2)`` float32, and each rank scales its heads by the
whole row's statistic with its slice of ``w_q`` / ``w_k``. Key heads replicated on
several ranks (``tp > KVH``) are counted once per holder in the reduced sum; dividing
by ``tp * local width`` (not ``KVH * d``) counts them the same number of times, so the
mean is exact either way.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.parallel_state import ParallelContext


class HeadShardedNormWeight(nn.Module):
    """This rank's slice ``(local_heads * d,)`` of a full-width norm weight ``(total_heads * d,)``.

    Args:
        total_heads: heads of the whole model (``num_attention_heads`` or ``num_key_value_heads``).
        head_start: the first head this rank holds (``QKVParallelLinear.kv_head_start`` for keys).
        local_heads: heads this rank holds.
        head_dim: ``d``.
        ctx: the tensor-parallel group (for the device).
        dtype: the weight's dtype.
    """

    def __init__(self, total_heads: int, head_start: int, local_heads: int, head_dim: int, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.full_width, self.start = total_heads * head_dim, head_start * head_dim
        self.weight = new_parameter((local_heads * head_dim,), dtype, ctx.device, self.weight_loader)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's heads' columns of the ``(total_heads * d,)`` checkpoint weight."""
        check_shape(source, (self.full_width,))
        copy_into(param.data, read_narrow(source, 0, self.start, param.shape[0]))


def full_width_qk_norm(qkv: torch.Tensor, q_size: int, kv_size: int, q_norm: HeadShardedNormWeight,
                       k_norm: HeadShardedNormWeight, eps: float, ctx: ParallelContext) -> torch.Tensor:
    """Normalise the query and key columns of this rank's fused projection by the whole model's row statistics.

    Args:
        qkv: ``(T, q_size + 2 * kv_size)`` this rank's fused q/k/v output (queries, keys, values).
        q_size, kv_size: this rank's query and key widths (``num_heads * d``, ``num_kv_heads * d``).
        q_norm, k_norm: this rank's weight slices.
        eps: the RMSNorm epsilon (``rms_norm_eps``).
        ctx: the tensor-parallel group; one all-reduce of ``(T, 2)`` float32 when ``tp > 1``.

    Returns:
        ``(T, q_size + 2 * kv_size)`` in ``qkv.dtype``: q and k normalised, v unchanged.
    """
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q32, k32 = q.float(), k.float()  # (T, q_size), (T, kv_size)
    sums = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1)  # (T, 2) this rank's sums of squares
    sums = ctx.all_reduce(sums)  # (T, 2) over every rank's heads (a no-op at tp 1)
    # Python-scalar widths: no host-to-device copy, so a decode step stays capturable in a CUDA graph.
    inv_q = torch.rsqrt(sums[:, :1] / (q_size * ctx.tp_size) + eps)  # (T, 1)
    inv_k = torch.rsqrt(sums[:, 1:] / (kv_size * ctx.tp_size) + eps)  # (T, 1)
    q = q_norm.weight * (q32 * inv_q).to(qkv.dtype)  # (T, q_size)
    k = k_norm.weight * (k32 * inv_k).to(qkv.dtype)  # (T, kv_size)
    return torch.cat([q, k, v], dim=-1)  # (T, q_size + 2 * kv_size)
